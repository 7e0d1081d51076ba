"""Scope constructors for DESIGN section 1's `global`, `group` and `micro_batch` scopes.

global_scope       one pool; sums all-reduced over `group` (the data-parallel group, or
                   DP x CP), in float64. Layout-independent.
group_scope        one pool per prompt; a prompt group never spans ranks, so no reduction.
                   Layout-independent.
micro_batch_scope  one pool per micro-batch on this rank; no reduction. The result depends
                   on how the batch is split, which this constructor warns about.
"""

import functools
import warnings

import torch
from torch import Tensor

from cwgrpo_megatron.algo.names import SCOPE_NAMES
from cwgrpo_megatron.algo.scope import Scope, pools_from_index
from cwgrpo_megatron.comm.collectives import Group, sum_over


class LayoutDependentWarning(UserWarning):
    """A statistic whose value changes with the parallel layout or micro-batch split."""


def global_scope(
    batch_size: int,
    *,
    group: Group = None,
    device: torch.device | str = "cpu",
    row_order: Tensor | None = None,
) -> Scope:
    """All counted tokens of every rank of `group` in one pool. `row_order [b]` is each row's
    position in the global batch (see `Scope`)."""
    return Scope(
        segment=torch.zeros(batch_size, dtype=torch.long, device=device),
        num_segments=1,
        reduce_sum=functools.partial(sum_over, group=group),
        name="global",
        row_order=row_order,
    )


def group_scope(prompt_index: Tensor, *, row_order: Tensor | None = None) -> Scope:
    """One pool per prompt; `prompt_index [b]` labels the prompt of each row."""
    return pools_from_index(prompt_index, name="group", row_order=row_order)


def micro_batch_scope(micro_batch_index: Tensor, *, row_order: Tensor | None = None) -> Scope:
    """One pool per local micro-batch; `micro_batch_index [b]` labels each row's micro-batch."""
    warnings.warn(
        "cov_scope=micro_batch pools covariance statistics per micro-batch on each rank, so the "
        "weights change with the parallel layout and micro-batch count; use global or group "
        "for layout-independent results",
        LayoutDependentWarning,
        stacklevel=2,
    )
    return pools_from_index(micro_batch_index, name="micro_batch", row_order=row_order)


def make_scope(
    name: str,
    *,
    batch_size: int,
    group: Group = None,
    prompt_index: Tensor | None = None,
    micro_batch_index: Tensor | None = None,
    row_order: Tensor | None = None,
    device: torch.device | str = "cpu",
) -> Scope:
    """The scope named by `algo.cov_scope`, with the index it needs; `row_order [b]` is each
    row's position in the global batch (the tie-break order of kl_cov)."""
    if name == "global":
        return global_scope(batch_size, group=group, device=device, row_order=row_order)
    if name == "group":
        if prompt_index is None:
            raise ValueError("cov_scope=group needs prompt_index [b]")
        return group_scope(prompt_index, row_order=row_order)
    if name == "micro_batch":
        if micro_batch_index is None:
            raise ValueError("cov_scope=micro_batch needs micro_batch_index [b]")
        return micro_batch_scope(micro_batch_index, row_order=row_order)
    raise ValueError(f"unknown cov_scope {name!r}; choose one of: {', '.join(SCOPE_NAMES)}")
