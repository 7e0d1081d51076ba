"""Rollout engines behind one protocol (`base.RolloutEngine`), chosen by name.

    engine = get_engine("vllm")(model_dir, dtype="float32", max_model_len=1024, seed=0)
    groups = engine.generate(prompt_ids, n=8, sampling=SamplingConfig(temperature=0.7))

`build_engine(rollout_cfg, model_dir, dtype=..., seed=...)` starts the engine that a run's
`rollout` settings describe. Backends are imported only when asked for, so
`import cwgrpo_megatron` never loads vLLM.
"""

from collections.abc import Sequence

import torch

from cwgrpo_megatron.rollout.base import (
    Completion,
    RolloutEngine,
    RolloutGroup,
    SamplingConfig,
)
from cwgrpo_megatron.rollout.config import RolloutConfig
from cwgrpo_megatron.rollout.names import ROLLOUT_BACKENDS


@ROLLOUT_BACKENDS.register("vllm")
def _vllm():
    from cwgrpo_megatron.rollout.vllm_engine import VLLMEngine

    return VLLMEngine


@ROLLOUT_BACKENDS.register("torch")
def _torch():
    from cwgrpo_megatron.rollout.torch_engine import TorchEngine

    return TorchEngine


def get_engine(name: str) -> type:
    """The engine class of backend `name` (imports it now)."""
    return ROLLOUT_BACKENDS.get(name)()


def build_engine(
    cfg: RolloutConfig,
    model_dir: str,
    *,
    dtype: str,
    seed: int,
    devices: Sequence[int] | None = None,
    cpu_cores: Sequence[int] | None = None,
) -> RolloutEngine:
    """Start the engine `cfg` describes on `model_dir` (an HF checkpoint folder), in `dtype`,
    seeded with `seed`, on the GPUs `devices` of this node (vllm; None: vLLM's choice), its
    processes bound to `cpu_cores` (vllm; None: unbound)."""
    common = dict(
        dtype=dtype,
        seed=seed,
        max_model_len=cfg.max_model_len,
        long_prompt=cfg.long_prompt,
    )
    if cfg.backend != "vllm":
        return get_engine(cfg.backend)(model_dir, **common)
    return get_engine("vllm")(
        model_dir,
        **common,
        in_process=False if cfg.separate else cfg.in_process,
        kv_cache_bytes=cfg.kv_cache_mb << 20,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_sleep_mode=engine_sleep_level(cfg, cuda=torch.cuda.is_available()) > 0,
        enforce_eager=eager(cfg, cuda=torch.cuda.is_available()),
        shm_dir=cfg.shm_dir,
        weight_sync=cfg.weight_sync,
        tensor_parallel_size=cfg.tp,
        devices=devices,
        cpu_cores=cpu_cores,
    )


def eager(cfg: RolloutConfig, *, cuda: bool) -> bool:
    """rollout.enforce_eager, or when it is unset: eager on CPU, compiled on a GPU."""
    return (not cuda) if cfg.enforce_eager is None else cfg.enforce_eager


def engine_sleep_level(cfg: RolloutConfig, *, cuda: bool) -> int:
    """rollout.sleep_level, or when it is unset: 2 on GPUs, 0 on CPU (vLLM's CPU build has no
    sleep mode) and with separate placement (the engines' devices are their own)."""
    return (2 if cuda and not cfg.separate else 0) if cfg.sleep_level is None else cfg.sleep_level


def sampling_config(cfg: RolloutConfig, *, temperature: float, seed: int | None = None):
    """A rollout's sampling parameters: the trainer's temperature (train.temperature: one value
    for both sides), `cfg`'s truncation and length."""
    return SamplingConfig(
        temperature=temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_tokens,
        seed=seed,
    )


__all__ = [
    "ROLLOUT_BACKENDS",
    "Completion",
    "RolloutEngine",
    "RolloutGroup",
    "SamplingConfig",
    "build_engine",
    "get_engine",
    "sampling_config",
    "engine_sleep_level",
]
