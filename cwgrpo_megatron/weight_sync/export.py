"""Stream the Megatron model as full HF-named tensors (DESIGN section 4, step 10).

For every parameter of every pipeline stage, in stage order:

    shard [.., n/tp, ..] on the owning stage, cast to the export dtype
      -> broadcast over the PP group from the owning stage   (every stage holds the shard)
      -> all-gather over the TP group                         (every rank holds all tp shards)
      -> `convert.mapping.to_hf`: fuse the shards, split QKV / gate-up, strip vocab padding

so every rank of the model-parallel group ends with the same full HF tensors. Communication per
parameter: one broadcast of its shard over PP (pp > 1) and one all-gather over TP (tp > 1). The
shard shapes come from the mapping (`megatron_shape`), so receivers need no shape messages.

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
    tp, pp = size_of(groups.tp), size_of(groups.pp)
    my_stage = rank_in(groups.pp)
    padded = padded_vocab_size(arch.vocab_size, tp=tp)
    for stage, item in export_items(arch, pp=pp, te_spec=groups.te_spec):
        if stage == my_stage:
            shard = params[item.megatron_name].detach().to(device=device, dtype=dtype)
        else:
            shape = megatron_shape(item.rule, arch, tp=tp, padded_vocab=padded)
            shard = torch.empty(shape, dtype=dtype, device=device)
        shard = broadcast_into(shard, global_rank(groups.pp, stage), groups.pp)
        full = to_hf(item.rule, all_gather(shard, groups.tp), arch)
        yield from zip(item.hf_names, full, strict=True)


def export_items(arch: ModelArch, *, pp: int, te_spec: bool) -> list[tuple[int, StageParam]]:
    """(stage, parameter) in the order `hf_tensors` yields them: stage by stage, a tied output
    layer on the last stage left out (it repeats the embedding)."""
    out, seen = [], set()
    for stage in range(pp):
        for item in stage_params(arch, pp_rank=stage, pp=pp, te_spec=te_spec):
            if not all(name in seen for name in item.hf_names):
                out.append((stage, item))
                seen.update(item.hf_names)
    return out


def export_names(arch: ModelArch, *, pp: int, te_spec: bool) -> list[str]:
    """The HF names `hf_tensors` yields, in its order."""
    return [
        name for _, item in export_items(arch, pp=pp, te_spec=te_spec) for name in item.hf_names
    ]
