"""The trainer's side of vLLM's own weight transfer (an engine started with
`weight_transfer_config`), shared by its two backends we use: `ipc` (engines on the trainer's
GPUs, `weight_sync.ipc`) and `nccl` (engines on GPUs of their own, `weight_sync.nccl`).

vLLM's trainer engines iterate a `WeightSource` on every trainer rank, since producing each
tensor is a collective (here the export's PP broadcast and TP all-gather), and call the engine
through a `VLLMWeightSyncClient` only on the sender: each engine's owner, with its `vllm.LLM`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from cwgrpo_megatron.weight_sync.senders import BUFFER_BYTES

__all__ = ["BUFFER_BYTES", "HFSource", "LLMClient", "NoClient", "largest_bytes"]


class HFSource(WeightSource):
    """A fresh pass over the trainer's model as HF tensors each time it is iterated."""

    def __init__(
        self,
        tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        metadata: list[tuple[str, torch.dtype, tuple[int, ...]]],
    ) -> None:
        self._tensors = tensors
        self._metadata = [ParamMeta(name, dtype, tuple(shape)) for name, dtype, shape in metadata]

    def metadata(self) -> list[ParamMeta]:
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors()


class LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over an offline `vllm.LLM` (in this process; its
    engine processes do the loading)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class NoClient:
    """The client of a rank that owns no engine: it joins the collectives and ships nothing
    (vLLM calls none of these on a rank that is not a sender)."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"a rank without an engine was asked to {name}")


def largest_bytes(source: WeightSource) -> int:
    """The largest tensor `source` yields, in bytes: vLLM's packed buffer must hold it."""
    return max(torch.Size(m.shape).numel() * m.dtype.itemsize for m in source.metadata())
