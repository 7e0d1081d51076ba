"""Purpose-named collectives with explicit groups. `group=None` means this process alone.

Unlike torch.distributed, where group=None is the WORLD group, here None is a no-op, so the
same code runs in one process and under torchrun. Every helper returns its result and never
modifies its argument in place, except `broadcast_into`, which fills a receive buffer.
"""

import datetime
import os
import re
import socket
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None


def world_group() -> Group:
    """Every process of the job, or None when it is this one process alone."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def job_rank() -> int:
    """This process's rank in the job (0 when it runs alone)."""
    return rank_in(world_group())


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


def broadcast_into(buffer: Tensor, src: int, group: Group) -> Tensor:
    """`buffer` filled with global rank `src`'s tensor on every other rank of `group`, and
    returned. The one in-place helper: streaming a model must not copy each tensor once more
    (on `src` the tensor is only read)."""
    if group is not None and size_of(group) > 1:
        dist.broadcast(buffer, src=src, group=group)
    return buffer


def broadcast_object(obj, src: int, group: Group):
    """Global rank `src`'s picklable `obj` on every rank of `group` (others pass anything)."""
    if group is None or size_of(group) == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Group) -> None:
    """Wait until every rank of `group` got here (orders writes to memory the ranks share)."""
    if group is not None and size_of(group) > 1:
        dist.barrier(group=group)


def global_rank(group: Group, group_rank: int) -> int:
    """The global rank of member `group_rank` of `group` (0 for the one-process group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_gather(t: Tensor, group: Group) -> list[Tensor]:
    """Every rank's `t` (same shape and dtype on all ranks), in group-rank order."""
    if group is None or size_of(group) == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size_of(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


_CONTROL_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each control group (`open_control_group`) -> (its timeout in minutes, the WORLD it was made
in): what its timeout error names, and whether it still exists to be destroyed."""


class CollectiveTimeout(RuntimeError):
    """A peer did not reach an object collective in time."""


def open_control_group(minutes: float) -> Group:
    """A gloo group of every process of the job with a timeout of `minutes`, for the job's
    object collectives (`all_gather_objects`, and so `fail_together` and
    `all_gather_or_fail`): over NCCL they would hold GPU memory and time out after NCCL's own
    default while a rank evaluates. The caller passes it as their `group`; past the timeout
    they raise `CollectiveTimeout`. Collective: every process calls it. None (this process
    alone) in a one-process job."""
    if world_group() is None:
        return None
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=minutes))
    _CONTROL_GROUPS[group] = (minutes, dist.group.WORLD)
    return group


def close_control_group(group: Group) -> None:
    """Destroy `group` (an `open_control_group`'s), unless the world it was made in is gone."""
    made = _CONTROL_GROUPS.pop(group, None) if group is not None else None
    if made is not None and dist.is_initialized() and made[1] is dist.group.WORLD:
        dist.destroy_process_group(group)


def all_gather_objects(obj, group: Group) -> list:
    """Every rank's picklable `obj`, in group-rank order, on every rank of `group`; a control
    group's timeout (`open_control_group`) raises CollectiveTimeout."""
    if group is None or size_of(group) == 1:
        return [obj]
    out = [None] * size_of(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as err:
        control = _CONTROL_GROUPS.get(group)
        if control is None or not re.search(r"[Tt]imed? ?out", str(err)):
            raise
        raise CollectiveTimeout(
            f"a peer did not reach this point within run.collective_timeout_min="
            f"{control[0]} minutes ({type(err).__name__}): raise it if a phase on "
            "some ranks legitimately takes longer (a large evaluation); otherwise the other "
            "ranks' logs say which one stopped"
        ) from err
    return out


def node_of_each_rank(group: Group) -> list[str]:
    """The node of every rank of `group`, in group-rank order: torchrun's node rank
    (`GROUP_RANK`: one launch is one node, even beside another on the same machine), else the
    host name. One all_gather_object."""
    here = os.environ.get("GROUP_RANK")
    return all_gather_objects(socket.gethostname() if here is None else f"node {here}", group)


def exchange(sends: list[tuple[Tensor, int, int]], recvs: list[tuple[Tensor, int, int]]) -> None:
    """Point to point over the default group: each (tensor, global rank, tag) of `sends` goes to
    that rank, each of `recvs` is filled from that rank's send with the same tag; returns when
    all are done. Nothing to do (both lists empty) costs nothing."""
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
