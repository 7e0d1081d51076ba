"""Weight sync from the Megatron model into the rollout engine, and the log-prob check.

One engine, on global rank 0 (`ENGINE_RANK`). Per sync, the model-parallel group of data-parallel
rank 0 (the ranks that hold rank 0's copy of the model) takes part (`sync_weights`: shards
written into the engine's shared-memory buffer, or the streamed export); other data-parallel
replicas do nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.convert.mapping import hf_shapes
from cwgrpo_megatron.dist import broadcast_from, vocab_parallel_logprob_entropy
from cwgrpo_megatron.dist.collectives import barrier, broadcast_object, max_over
from cwgrpo_megatron.megatron.forward import forward_logits
from cwgrpo_megatron.megatron.model import DTYPES, use_transformer_engine
from cwgrpo_megatron.weight_sync.export import ExportGroups, hf_tensors
from cwgrpo_megatron.weight_sync.shm import SharedWeights, write_shards

ENGINE_RANK = 0


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def export_groups() -> ExportGroups:
    tp, pp = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    return ExportGroups(
        tp=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        pp=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
        te_spec=use_transformer_engine(),
    )


def hf_weights(model, arch: ModelArch, *, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model as HF-named full tensors in `dtype`; a collective over TP x PP."""
    params = dict(unwrap(model).named_parameters())
    device = next(iter(params.values())).device
    return hf_tensors(params, arch, groups=export_groups(), dtype=DTYPES[dtype], device=device)


def in_engine_group() -> bool:
    """This rank takes part in the export to the engine (it shares rank 0's model copy)."""
    return parallel_state.get_data_parallel_rank() == 0


@dataclass(frozen=True)
class SyncResult:
    version: int | None
    """The engine's policy version after the sync, on rank 0; None elsewhere."""
    path: str
    """How the weights went: "shared" (shards written into the engine's buffer), "stream"
    (the export's collectives), or "idle" (a rank outside data-parallel rank 0's group)."""


def sync_weights(model, arch: ModelArch, engine, *, dtype: str) -> SyncResult:
    """Push the model into `engine` (held by rank 0 only; None elsewhere). Every rank calls this.

    Over the model-parallel group of data-parallel rank 0, one of two paths:

    - the engine offers a shared-memory buffer (vLLM, but for an in-process engine on a GPU) and
      every rank of the group sees it (same node): each rank writes its own shards into it
      (`weight_sync.shm`), a barrier, rank 0's engine loads it. Nothing crosses the network.
    - otherwise the export streams full tensors to rank 0 (PP broadcast, TP all-gather).

    Control traffic: one object broadcast (rank 0's verdict on the engine and its buffer), a
    barrier, and a 1-element max over the group the first time a buffer is offered.
    """
    if (engine is not None) != (dist.get_rank() == ENGINE_RANK):
        raise ValueError(f"exactly global rank {ENGINE_RANK} must hold the rollout engine")
    if not in_engine_group():
        return SyncResult(version=None, path="idle")
    group = parallel_state.get_model_parallel_group()
    # every peer must learn that rank 0 refuses, or they would wait in the export's collectives
    refusal, buffer = broadcast_object(_offer(engine, arch, dtype), ENGINE_RANK, group)
    if refusal is not None:
        raise ValueError(refusal)
    if buffer is not None and _all_see(buffer, group):
        write_shards(buffer, dict(unwrap(model).named_parameters()), arch, **_ranks())
        barrier(group)  # every shard is in before the engine reads
        if engine is not None:
            engine.load_shared_weights()
        path = "shared"
    else:
        stream = hf_weights(model, arch, dtype=dtype)
        if engine is None:
            for _ in stream:  # the collectives need every peer; the tensors are not needed here
                pass
        else:
            engine.update_weights(stream)
        path = "stream"
    return SyncResult(version=None if engine is None else engine.version, path=path)


def _offer(engine, arch: ModelArch, dtype: str) -> tuple[str | None, SharedWeights | None]:
    """Rank 0's verdict: why the sync cannot happen (None: it can), and the engine's buffer."""
    if engine is None:
        return None, None
    if engine.shapes != hf_shapes(arch):
        return (
            "the rollout engine's checkpoint has other tensor names or shapes than the trainer's "
            "model: start the engine from the checkpoint the trainer was built from"
        ), None
    try:
        return None, engine.shared_weights(DTYPES[dtype])
    except (OSError, RuntimeError) as err:  # e.g. too little shared memory
        return f"the rollout engine's weight buffer could not be made: {err}", None


_seen_by_all: dict[str, bool] = {}


def _all_see(buffer: SharedWeights, group) -> bool:
    """Every rank of `group` sees the buffer's file (False when the group spans nodes). Asked
    once per buffer: the answer, reduced over the group, is the same on every rank."""
    if buffer.token not in _seen_by_all:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        blind = torch.tensor([0.0 if buffer.visible() else 1.0], device=device)
        _seen_by_all[buffer.token] = not bool(max_over(blind, group).item())
    return _seen_by_all[buffer.token]


def _ranks() -> dict:
    return dict(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        te_spec=use_transformer_engine(),
    )


def score(model, arch: ModelArch, tokens: torch.Tensor) -> torch.Tensor | None:
    """log p(x_t | x_<t) `[b, s-1]` at temperature 1 from the vocab-parallel logits, on rank 0
    of the engine group (sent from the last stage over PP); None on ranks outside that group."""
    if not in_engine_group():
        return None
    logits = forward_logits(model, tokens)
    last = parallel_state.is_pipeline_last_stage()
    logp = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, device=tokens.device)
    if last:
        target = tokens[:, 1:]
        logp, _ = vocab_parallel_logprob_entropy(
            logits[:, :-1].float().contiguous(),
            target,
            group=parallel_state.get_tensor_model_parallel_group(),
            vocab_size=arch.vocab_size,
        )
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    return broadcast_from(logp.float(), src, pp_group).cpu()
