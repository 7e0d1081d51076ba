"""The receiving side of each weight path (`weight_sync.names`) for the vLLM engine: which path
an engine takes, and how it loads what arrives.

    shm     the buffer in rollout.shm_dir (`weight_sync.shm`, made at the first `shm_buffer`
            and kept until shutdown: one copy of the model in the update's dtype); the worker
            extension `weight_sync.vllm_worker.SharedWeightLoader` loads views of its pages,
            in place on CPU (`weight_sync.vllm_inplace`: half the time of vLLM's reload)
    ipc     vLLM's weight transfer (its `weight_transfer_config`), from every rank on the
    nccl    engine's GPUs, or from the owner to an engine on GPUs of its own
    stream  full tensors; through the buffer (`shm.fill`, so that a bad update fails before
            the engine is touched), except in-process on a GPU, where the trainer's device
            tensors go straight into the worker's `reload_weights`

After every load the prefix cache is reset: cached KV blocks were computed with the old
weights (skipping it gave log-prob errors of about 10 on a 168-token prompt). A failed load
brings the engine back to the start checkpoint and re-raises.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import Tensor

from cwgrpo_megatron.rollout.base import ENGINE_DTYPES, EngineDeadError, checked_weights
from cwgrpo_megatron.weight_sync import shm
from cwgrpo_megatron.weight_sync.names import TRANSFER_PATHS


def engine_sync_path(
    weight_sync: str | None, *, in_process: bool, devices: list[int] | None
) -> str:
    """rollout.weight_sync as this engine's path, the one place it is resolved. Unset, on GPUs
    with engine processes: ipc when the engine's `devices` include this rank's GPU
    (colocated), else nccl (separate placement: from the owner's GPU to the engine's). An
    in-process GPU engine takes the stream (it reads the trainer's tensors directly); CPU and
    shm take shm. ipc and nccl need a GPU and engine processes, and nccl the engine on GPUs
    other than this rank's: NCCL refuses two ranks of one group on one GPU."""
    cuda = torch.cuda.is_available()
    if weight_sync in TRANSFER_PATHS and (in_process or not cuda):
        raise ValueError(
            f"rollout.weight_sync={weight_sync} needs a GPU and engine processes: leave it unset "
            "(ipc on GPUs, shm on CPU) or set shm"
        )
    if weight_sync == "nccl" and (devices is None or torch.cuda.current_device() in devices):
        raise ValueError(
            "rollout.weight_sync=nccl needs the engine on GPUs the trainer does not use: set "
            "rollout.placement=separate, or leave rollout.weight_sync unset"
        )
    if in_process and cuda:
        return "stream"
    if weight_sync == "shm" or not cuda:
        return "shm"
    if weight_sync is not None:
        return weight_sync
    return "ipc" if devices is None or torch.cuda.current_device() in devices else "nccl"


class VLLMWeights:
    """The `WeightReceiver` side of `VLLMEngine`. What it needs of the engine: `llm`,
    `shapes`, `shm_dir`, `sync_path`, `version`, `_engine_args["dtype"]`, `_guarded(call)`
    (the call under the in-process state guard and the watchdog) and `_recover()` (the engine
    back at the start checkpoint; the buffer survives it)."""

    _buffer: shm.SharedWeights | None = None
    _buffer_finalizer = None
    last_load: str | None = None
    """How the engine took the last load: "in_place" (`vllm_inplace`) or "reload" (vLLM's
    `reload_weights`) from the buffer, else the transfer's path; None before the first."""

    def load_stream(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        stream = checked_weights(weights, self.shapes)
        if self.sync_path == "stream":
            self._load(lambda: self.llm.collective_rpc("cwgrpo_reload", args=(stream,)))
            return
        # a bad tensor fails here, before the engine is touched
        buffer = self._buffer or self.shm_buffer(ENGINE_DTYPES[self._engine_args["dtype"]])
        shm.fill(buffer, stream)
        self.load_shm()

    def shm_buffer(self, dtype: torch.dtype) -> shm.SharedWeights:
        if self.sync_path == "stream":
            raise NotImplementedError("an in-process engine on a GPU reads the trainer's tensors")
        if self._buffer is None or self._buffer.torch_dtype != dtype:
            self._release_buffer()
            self._buffer = shm.create(self.shapes, dtype, folder=self.shm_dir)
            self._buffer_finalizer = weakref.finalize(self, shm.remove, self._buffer)
        return self._buffer

    def load_shm(self) -> None:
        if self._buffer is None:
            raise RuntimeError("load_shm before shm_buffer: nothing was written")
        message = self._buffer.to_message()
        loads = self._load(lambda: self.llm.collective_rpc("cwgrpo_load_shared", args=(message,)))
        self.last_load = loads[0]

    def load_transfer(self, send) -> None:
        """Load the weights that `send(llm)` transfers into this engine through vLLM's weight
        transfer (`weight_sync.ipc` or `.nccl`: every rank of the job sends at once, this
        engine's owner with its `vllm.LLM`)."""
        if self.sync_path not in TRANSFER_PATHS:
            raise RuntimeError("this engine was not started for vLLM's weight transfer")
        self._load(lambda: send(self.llm))
        self.last_load = self.sync_path

    def _release_buffer(self) -> None:
        if self._buffer_finalizer is not None:
            self._buffer_finalizer()
        self._buffer, self._buffer_finalizer = None, None

    def _load(self, call):
        """Run the engine-side load `call`, then reset the prefix cache and bump the version;
        a failed load rebuilds the engine (`_recover`) and re-raises; dead engine processes
        raise EngineDeadError."""
        try:
            result = self._guarded(call, restore=True)
        except EngineDeadError:
            raise  # nothing to restore: the processes are gone, and the run stops
        except BaseException:
            self._recover()
            raise
        self.llm.reset_prefix_cache()
        self.version += 1
        return result
