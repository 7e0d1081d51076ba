"""What the weight sync needs of an engine: the receiver's side of the protocol, which every
rollout engine implements (`rollout.base.RolloutEngine` extends it).

Three paths, chosen by the engine (`megatron.publish.sync_weights` asks it):

    buffer   `shared_weights(dtype)` hands out a shared-memory buffer laid out as the HF model
             (`weight_sync.shm`); the trainer's ranks write their shards into it, then
             `load_shared_weights()` loads it (in vLLM's worker: `weight_sync.vllm_worker`)
    stream   `update_weights(tensors)` takes the whole model as HF-named full tensors
             (`weight_sync.export`), for an engine without a buffer
    transfer `receive(send)`: vLLM engines on GPUs take the tensors the trainer's ranks export
             on their GPUs through vLLM's weight transfer: over CUDA IPC from every rank on
             the engine's GPUs (`weight_sync.ipc`), or over NCCL from the engine's owner to
             engines on GPUs of their own (`weight_sync.nccl`)
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
    transfer: str | None
    """The vLLM weight transfer backend that `receive` takes ("ipc" or "nccl"); None: the
    buffer or the stream."""

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named full tensors (the whole model, streamed); bumps `version`."""
        ...

    def shared_weights(self, dtype: torch.dtype) -> SharedWeights | None:
        """A shared-memory buffer laid out as the HF model that the trainer's ranks may write
        their shards into; None when `update_weights` is the faster path (an engine that reads
        the trainer's tensors themselves, e.g. in-process on the same GPU)."""
        ...

    def load_shared_weights(self) -> None:
        """Load what the buffer holds now (every tensor must have been written); bumps
        `version`."""
        ...

    def receive(self, send) -> None:
        """Load what `send(llm)` transfers (`weight_sync.ipc.send_ipc` or
        `weight_sync.nccl.send_nccl`, which every rank runs at once); bumps `version`."""
        ...
