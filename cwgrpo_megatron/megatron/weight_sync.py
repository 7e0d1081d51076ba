"""Weight sync from the Megatron model into the rollout engine, and the log-prob check.

One engine, on global rank 0 (`ENGINE_RANK`). Per sync, the model-parallel group of data-parallel
rank 0 (the ranks that hold rank 0's copy of the model) walks the export together
(`weight_sync.export`: broadcast over PP, all-gather over TP); rank 0 streams the tensors into
the engine, its model-parallel peers drop them. Other data-parallel replicas do nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.convert.mapping import hf_shapes
from cwgrpo_megatron.dist import broadcast_from, vocab_parallel_logprob_entropy
from cwgrpo_megatron.megatron.forward import forward_logits
from cwgrpo_megatron.megatron.model import DTYPES, use_transformer_engine
from cwgrpo_megatron.weight_sync.export import ExportGroups, hf_tensors

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


def sync_weights(model, arch: ModelArch, engine, *, dtype: str) -> int | None:
    """Push the model into `engine` (held by rank 0 only; None elsewhere). Every rank calls this.

    Returns the engine's new policy version on rank 0, None elsewhere.
    """
    if (engine is not None) != (dist.get_rank() == ENGINE_RANK):
        raise ValueError(f"exactly global rank {ENGINE_RANK} must hold the rollout engine")
    if not in_engine_group():
        return None
    # every peer must learn that rank 0 refuses, or they would wait in the export's collectives
    same = engine is None or engine.shapes == hf_shapes(arch)
    device = next(unwrap(model).parameters()).device
    verdict = torch.tensor([float(same)], device=device)
    verdict = broadcast_from(verdict, ENGINE_RANK, parallel_state.get_model_parallel_group())
    if not bool(verdict.item()):
        raise ValueError(
            "the rollout engine's checkpoint has other tensor names or shapes than the trainer's "
            "model: start the engine from the checkpoint the trainer was built from"
        )
    stream = hf_weights(model, arch, dtype=dtype)
    if engine is None:
        for _ in stream:  # the collectives need every peer; the tensors are not needed here
            pass
        return None
    engine.update_weights(stream)
    return engine.version


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
