"""Process-group start-up for tools and entry points: torchrun, or one local process."""

from __future__ import annotations

import datetime
import importlib.util
import os

import torch
import torch.distributed as dist

from cwgrpo_megatron.common.processes import free_port


def init_distributed(*, timeout_s: int = 1800) -> None:
    """Initialise torch.distributed from torchrun's environment, or as a world of one.

    Backend: nccl with CUDA, gloo otherwise. With CUDA and Transformer Engine,
    CUDA_DEVICE_MAX_CONNECTIONS=1 unless set (sequence parallelism needs it).
    """
    if dist.is_initialized():
        return
    if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine"):
        # sequence parallelism (`model.fusion_settings`) orders each TP collective before the
        # GEMM that needs it only with one hardware queue; it must be set before CUDA starts
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timeout,
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
