"""Stream the Megatron model as full HF-named tensors (DESIGN section 4, step 10).

For every parameter of every pipeline stage, in stage order:

    shard [.., n/tp, ..] on the owning stage, cast to the export dtype
      -> broadcast over the PP group from the owning stage   (every stage holds the shard)
      -> all-gather over the TP group                         (every rank holds all tp shards)
      -> `convert.mapping.to_hf`: fuse the shards, split QKV / gate-up, strip vocab padding

so every rank of the model-parallel group ends with the same full HF tensors. Communication per
parameter: one broadcast of its shard over PP (pp > 1) and one all-gather over TP (tp > 1). The
shard shapes come from the mapping (`megatron_shape`), so receivers need no shape messages.

A MoE model's experts are spread over the expert-parallel ranks: an expert owned by EP rank e
of a stage goes

    shard [.., f/expert_tp, ..] on EP rank e of the owning stage
      -> broadcast over the EP group from rank e              (ep > 1)
      -> broadcast over the PP group from the owning stage
      -> all-gather over the expert-TP group                  (expert_tp > 1)

so the export takes every rank of the EP group, not only data-parallel rank 0's replica.

No tensor is copied on the way except where the HF layout differs (QKV split, dtype cast,
gathering TP shards): in one process the engine reads the trainer's parameters themselves.

One tensor is alive at a time (plus the shards being gathered), never the whole model: the
engine loads each as it comes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cwgrpo_megatron.comm.collectives import (
    Group,
    all_gather,
    broadcast_into,
    global_rank,
    rank_in,
    size_of,
)
from cwgrpo_megatron.convert.arch import ModelArch, padded_vocab_size
from cwgrpo_megatron.convert.mapping import StageParam, megatron_shape, stage_params, to_hf


@dataclass(frozen=True, kw_only=True)
class ExportGroups:
    """The groups the export walks; None means this process alone (tp = 1 or pp = 1)."""

    tp: Group = None
    pp: Group = None
    ep: Group = None
    expert_tp: Group = None
    te_spec: bool
    """Names of the norms differ with Transformer Engine's fused layer spec (no default: see
    `convert.mapping.stage_params`)."""


def hf_tensors(
    params: dict[str, Tensor],
    arch: ModelArch,
    *,
    groups: ExportGroups,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, Tensor]]:
    """(hf_name, full tensor in `dtype`) for the whole model, each name once, on every rank.

    `params` are this rank's Megatron parameters by name (`model.named_parameters()` of the
    unwrapped GPTModel). Every rank of the TP x PP group must iterate to the end: each tensor is
    a collective over both groups.
    """
    tp, pp, ep = size_of(groups.tp), size_of(groups.pp), size_of(groups.ep)
    expert_tp = size_of(groups.expert_tp)
    my_stage, my_ep = rank_in(groups.pp), rank_in(groups.ep)
    padded = padded_vocab_size(arch.vocab_size, tp=tp)
    for stage, owner, item in export_items(arch, pp=pp, ep=ep, te_spec=groups.te_spec):
        split = expert_tp if item.rule.expert else tp
        if stage == my_stage and owner in (None, my_ep):
            shard = params[item.megatron_name].detach().to(device=device, dtype=dtype)
        else:
            shape = megatron_shape(item.rule, arch, tp=split, padded_vocab=padded)
            shard = torch.empty(shape, dtype=dtype, device=device)
        if owner is not None and stage == my_stage:
            shard = broadcast_into(shard, global_rank(groups.ep, owner), groups.ep)
        shard = broadcast_into(shard, global_rank(groups.pp, stage), groups.pp)
        shards = all_gather(shard, groups.expert_tp if item.rule.expert else groups.tp)
        full = to_hf(item.rule, shards, arch)
        yield from zip(item.hf_names, full, strict=True)


def export_items(
    arch: ModelArch, *, pp: int, ep: int = 1, te_spec: bool
) -> list[tuple[int, int | None, StageParam]]:
    """(stage, owning EP rank, parameter) in the order `hf_tensors` yields them: stage by
    stage, each stage's experts EP rank by EP rank, a tied output layer on the last stage left
    out (it repeats the embedding). The EP rank is None for what every EP rank holds."""
    out, seen = [], set()
    for stage in range(pp):
        for owner in range(ep):
            for item in stage_params(
                arch, pp_rank=stage, pp=pp, ep_rank=owner, ep=ep, te_spec=te_spec
            ):
                if item.rule.expert or not all(name in seen for name in item.hf_names):
                    out.append((stage, owner if item.rule.expert else None, item))
                    seen.update(item.hf_names)
    return out


def export_names(arch: ModelArch, *, pp: int, ep: int = 1, te_spec: bool) -> list[str]:
    """The HF names `hf_tensors` yields, in its order."""
    return [
        name
        for _, _, item in export_items(arch, pp=pp, ep=ep, te_spec=te_spec)
        for name in item.hf_names
    ]
