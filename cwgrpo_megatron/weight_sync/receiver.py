"""What the weight sync needs of an engine: the receiver's side of the protocol, which every
rollout engine implements (`rollout.base.RolloutEngine` extends it).

Two paths, chosen by the engine (`megatron.publish.sync_weights` asks it):

    buffer   `shared_weights(dtype)` hands out a shared-memory buffer laid out as the HF model
             (`weight_sync.shm`); the trainer's ranks write their shards into it, then
             `load_shared_weights()` loads it (in vLLM's worker: `weight_sync.vllm_worker`)
    stream   `update_weights(tensors)` takes the whole model as HF-named full tensors
             (`weight_sync.export`), for an engine without a buffer
    ipc      `receive_ipc(send)`: vLLM engines on GPUs take the tensors every trainer rank
             exports on its own GPU, over CUDA IPC (`weight_sync.ipc`)
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
    ipc: bool
    """Updates come through `receive_ipc`."""

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

    def receive_ipc(self, send) -> None:
        """Load what `send(llm)` transfers over CUDA IPC (`weight_sync.ipc.send_ipc`, which
        every rank runs at once); bumps `version`."""
        ...
