"""What the weight sync needs of an engine: the receiving side of each weight path
(`weight_sync.names`), which every rollout engine implements (`rollout.base.RolloutEngine`
extends it). The trainer's side is `weight_sync.senders`.

    shm      `shm_buffer(dtype)` hands out a shared-memory buffer laid out as the HF model
             (`weight_sync.shm`); the trainer's ranks write their shards into it, then
             `load_shm()` loads it (in vLLM's worker: `weight_sync.vllm_worker`)
    ipc/nccl `load_transfer(send)`: a vLLM engine on GPUs takes the tensors the trainer's
             ranks export on their GPUs through vLLM's weight transfer: over CUDA IPC from
             every rank on the engine's GPUs (`weight_sync.ipc`), or over NCCL from the
             engine's owner to an engine on GPUs of its own (`weight_sync.nccl`)
    stream   `load_stream(tensors)` takes the whole model as HF-named full tensors
             (`weight_sync.export`)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from cwgrpo_megatron.weight_sync.shm import SharedWeights


class WeightReceiver(Protocol):
    version: int
    """Weight updates loaded so far."""
    shapes: dict[str, tuple[int, ...]]
    """The HF tensor names and shapes of the model the engine holds (the sync refuses an
    engine of another model)."""
    model_dir: str
    """The checkpoint the engine started from."""
    sync_path: str
    """The path this engine takes (`weight_sync.names.SYNC_PATHS`). An engine on ipc or nccl
    also has an shm buffer, for a sync whose shards cross nodes."""

    def load_stream(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """The stream path: load HF-named full tensors (the whole model, checked before the
        engine is touched); bumps `version`. Every engine takes it."""
        ...

    def shm_buffer(self, dtype: torch.dtype) -> SharedWeights:
        """The shm path: a shared-memory buffer laid out as the HF model, in `dtype`, that the
        trainer's ranks write their shards into (made at the first call, kept until the engine
        shuts down). NotImplementedError for an engine on the stream path."""
        ...

    def load_shm(self) -> None:
        """The shm path: load what the buffer holds now (every tensor must have been written);
        bumps `version`."""
        ...

    def load_transfer(self, send) -> None:
        """The ipc and nccl paths: load what `send(llm)` transfers (`weight_sync.ipc.send_ipc`
        or `weight_sync.nccl.send_nccl`, which every rank runs at once); bumps `version`."""
        ...
