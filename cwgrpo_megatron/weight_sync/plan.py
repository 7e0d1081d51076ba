"""Who writes which shard into which node's engine buffers, and what crosses the network.

Every node with an engine (a `Placement`, such as `rollout.replicas.Replicas`) needs the whole
model in each of its engines' shared-memory buffers (`weight_sync.shm`). A shard (`Shard`) is a
part of the model that a set of ranks hold alike: the dense parameters of pipeline stage s at
tensor-parallel rank t, key (s, t); in a MoE model also the experts of expert-parallel rank e
on stage s at expert-tensor-parallel rank t, key (s, t, e), whose holders cut across the dense
keys' (Megatron lays expert groups over TP x DP). For each such node n and each key:

    a rank of n holds the key  its first holder on n writes it into n's buffers: shared memory,
                               nothing crosses the network (every key, when PP, TP and EP lie
                               inside the node)
    no rank of n holds it      one holder on another node sends it, once, to one rank of n,
                               which writes it into n's buffers

Senders are spread over the data-parallel copies of a shard (holder n mod copies), receivers
over n's ranks (round robin over the keys n lacks), so no rank gathers the model. A node
receives, per sync, the bytes of the shards it lacks in the engine dtype (`received_bytes`), and
nothing is sent twice to a node. A tied output layer is never sent: the embedding's writer
covers it; a replicated parameter (a norm) only from tensor-parallel rank 0.

Pure bookkeeping: `megatron.publish` gathers the ranks' places, `weight_sync.senders` runs
the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cwgrpo_megatron.convert.arch import ModelArch, padded_vocab_size
from cwgrpo_megatron.convert.mapping import StageParam, megatron_shape, stage_params


class Placement(Protocol):
    """Where the engines are, as the plan reads it (`rollout.replicas.Replicas` is one)."""

    @property
    def nodes(self) -> Sequence[int]:
        """The node (0, 1, ...) of every global rank."""
        ...

    @property
    def owners(self) -> tuple[int, ...]:
        """The global ranks that own an engine."""
        ...

    def owned_by(self, rank: int) -> int | None:
        """The replica whose engine global rank `rank` owns, or None."""
        ...


@dataclass(frozen=True)
class Shard:
    """The dense parameters of pipeline stage `stage` at tensor-parallel rank `tp_rank`
    (`ep_rank` None), or the experts of expert-parallel rank `ep_rank` on that stage at
    expert-tensor-parallel rank `tp_rank`."""

    stage: int
    tp_rank: int
    ep_rank: int | None = None


@dataclass(frozen=True)
class Place:
    """What a rank holds: its pipeline stage and tensor-parallel rank, and in a MoE model
    (`ep_rank` not None) its expert-parallel and expert-tensor-parallel ranks."""

    stage: int
    tp_rank: int
    ep_rank: int | None = None
    expert_tp_rank: int = 0

    def shards(self) -> tuple[Shard, ...]:
        dense = Shard(self.stage, self.tp_rank)
        if self.ep_rank is None:
            return (dense,)
        return dense, Shard(self.stage, self.expert_tp_rank, self.ep_rank)


@dataclass(frozen=True)
class Transfer:
    """`shard` sent by global rank `src` to global rank `dst` (on another node)."""

    shard: Shard
    src: int
    dst: int


@dataclass(frozen=True)
class SyncPlan:
    replicas: Placement
    places: tuple[Place, ...]
    """What every global rank holds."""
    writes: tuple[tuple[int, Shard], ...]
    """(rank, shard): the ranks that write a shard of their own into their node's buffers."""
    transfers: tuple[Transfer, ...]
    """Shards sent across nodes, in the order every rank walks them."""
    tp: int
    pp: int
    ep: int = 1
    expert_tp: int = 1

    @classmethod
    def build(cls, replicas: Placement, places: Sequence[Place]) -> SyncPlan:
        places = tuple(places)
        held = [p.shards() for p in places]
        keys = sorted({k for shards in held for k in shards}, key=_order)
        holders = {k: [r for r, shards in enumerate(held) if k in shards] for k in keys}
        writes, transfers = [], []
        for node in sorted({replicas.nodes[o] for o in replicas.owners}):
            ranks = [r for r, n in enumerate(replicas.nodes) if n == node]
            missing = 0
            for key in keys:
                here = [r for r in holders[key] if replicas.nodes[r] == node]
                if here:
                    writes.append((here[0], key))
                    continue
                copies = holders[key]
                src, dst = copies[node % len(copies)], ranks[missing % len(ranks)]
                transfers.append(Transfer(key, src, dst))
                missing += 1
        experts = [p for p in places if p.ep_rank is not None]
        return cls(
            replicas=replicas,
            places=places,
            writes=tuple(writes),
            transfers=tuple(transfers),
            tp=1 + max(p.tp_rank for p in places),
            pp=1 + max(p.stage for p in places),
            ep=1 + max((p.ep_rank for p in experts), default=0),
            expert_tp=1 + max((p.expert_tp_rank for p in experts), default=0),
        )

    @property
    def writers(self) -> frozenset[int]:
        """The ranks that write into their node's buffers."""
        return frozenset(rank for rank, _ in self.writes)

    def tp_of(self, shard: Shard) -> int:
        """The tensor-parallel size that splits `shard`: TP, or expert TP for experts."""
        return self.tp if shard.ep_rank is None else self.expert_tp

    def items(self, arch: ModelArch, shard: Shard, *, te_spec: bool) -> list[StageParam]:
        """`sent_items` of `shard` in this plan's layout."""
        return sent_items(
            arch,
            stage=shard.stage,
            tp_rank=shard.tp_rank,
            pp=self.pp,
            ep_rank=shard.ep_rank,
            ep=self.ep,
            te_spec=te_spec,
        )

    def received_bytes(self, arch: ModelArch, dtype: torch.dtype, *, te_spec: bool):
        """Bytes each node receives from other nodes per sync: {node: bytes}, every node with an
        engine listed (0 when it holds every shard)."""
        out = {self.replicas.nodes[o]: 0 for o in self.replicas.owners}
        for t in self.transfers:
            tp = self.tp_of(t.shard)
            numel = sum(
                torch.Size(shard_shape(item, arch, tp=tp)).numel()
                for item in self.items(arch, t.shard, te_spec=te_spec)
            )
            out[self.replicas.nodes[t.dst]] += numel * torch.empty((), dtype=dtype).element_size()
        return out


def _order(shard: Shard) -> tuple[int, int, int]:
    """Stage by stage, each stage's dense shards before its experts'."""
    return shard.stage, -1 if shard.ep_rank is None else shard.ep_rank, shard.tp_rank


def written_items(
    arch: ModelArch, *, stage: int, pp: int, ep_rank: int = 0, ep: int = 1, te_spec: bool
) -> list[StageParam]:
    """The parameters of `stage` (and of expert-parallel rank `ep_rank`'s experts) whose HF
    tensors it writes: all but a tied output layer, whose HF tensor is the embedding that the
    first stage writes."""
    earlier = {
        name
        for before in range(stage)
        for item in stage_params(arch, pp_rank=before, pp=pp, te_spec=te_spec)
        for name in item.hf_names
    }
    return [
        item
        for item in stage_params(
            arch, pp_rank=stage, pp=pp, ep_rank=ep_rank, ep=ep, te_spec=te_spec
        )
        if not all(name in earlier for name in item.hf_names)
    ]


def sent_items(
    arch: ModelArch,
    *,
    stage: int,
    tp_rank: int,
    pp: int,
    ep_rank: int | None = None,
    ep: int = 1,
    te_spec: bool,
) -> list[StageParam]:
    """The parameters of shard (stage, tp_rank, ep_rank) that land in the HF model:
    `written_items` of its kind (the dense ones, or expert-parallel rank `ep_rank`'s experts),
    less the replicated ones at tp_rank > 0 (tensor-parallel rank 0 writes those)."""
    items = written_items(arch, stage=stage, pp=pp, ep_rank=ep_rank or 0, ep=ep, te_spec=te_spec)
    return [
        item
        for item in items
        if item.rule.expert == (ep_rank is not None)
        and (item.rule.tp_dim is not None or tp_rank == 0)
    ]


def shard_shape(item: StageParam, arch: ModelArch, *, tp: int) -> tuple[int, ...]:
    padded = padded_vocab_size(arch.vocab_size, tp=tp)
    return tuple(megatron_shape(item.rule, arch, tp=tp, padded_vocab=padded))
