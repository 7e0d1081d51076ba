"""Purpose-named collectives with explicit groups. `group=None` means this process alone.

Unlike torch.distributed, where group=None is the WORLD group, here None is a no-op, so the
same code runs in one process and under torchrun. Every helper returns its result and never
modifies its argument in place.
"""

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None


def rank_in(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def size_of(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(t: Tensor, op: dist.ReduceOp, group: Group) -> Tensor:
    out = t.clone()
    if group is not None and size_of(group) > 1:
        dist.all_reduce(out, op=op, group=group)
    return out


def sum_over(t: Tensor, group: Group) -> Tensor:
    """Elementwise sum of `t` over the ranks of `group`."""
    return _all_reduce(t, dist.ReduceOp.SUM, group)


def max_over(t: Tensor, group: Group) -> Tensor:
    """Elementwise max of `t` over the ranks of `group`."""
    return _all_reduce(t, dist.ReduceOp.MAX, group)


def broadcast_from(t: Tensor, src: int, group: Group) -> Tensor:
    """`t` as held by global rank `src`, on every rank of `group` (a copy; `t` is untouched)."""
    out = t.clone()
    if group is not None and size_of(group) > 1:
        dist.broadcast(out, src=src, group=group)
    return out
