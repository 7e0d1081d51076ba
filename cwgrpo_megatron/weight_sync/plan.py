"""Who writes which shard into which node's engine buffers, and what crosses the network.

Every node with an engine (a `Placement`, such as `rollout.replicas.Replicas`) needs the whole
model in each of its engines' shared-memory buffers (`weight_sync.shm`). A shard is what one
rank holds: the parameters of pipeline stage s at tensor-parallel rank t, key (s, t). For each
such node n and each key:

    a rank of n holds (s, t)   its first holder on n writes it into n's buffers: shared memory,
                               nothing crosses the network (every key, when PP and TP lie
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
class Place:
    """Which shard a rank holds: its pipeline stage and tensor-parallel rank."""

    stage: int
    tp_rank: int


@dataclass(frozen=True)
class Transfer:
    """Shard (stage, tp_rank) sent by global rank `src` to global rank `dst` (on another node)."""

    stage: int
    tp_rank: int
    src: int
    dst: int


@dataclass(frozen=True)
class SyncPlan:
    replicas: Placement
    places: tuple[Place, ...]
    """The shard of every global rank."""
    writers: frozenset[int]
    """The ranks that write their own shard into their node's buffers."""
    transfers: tuple[Transfer, ...]
    """Shards sent across nodes, in the order every rank walks them."""
    tp: int
    pp: int

    @classmethod
    def build(cls, replicas: Placement, places: Sequence[Place]) -> SyncPlan:
        places = tuple(places)
        tp = 1 + max(p.tp_rank for p in places)
        pp = 1 + max(p.stage for p in places)
        keys = [(s, t) for s in range(pp) for t in range(tp)]
        holders = {k: [r for r, p in enumerate(places) if (p.stage, p.tp_rank) == k] for k in keys}
        writers, transfers = set(), []
        for node in sorted({replicas.nodes[o] for o in replicas.owners}):
            ranks = [r for r, n in enumerate(replicas.nodes) if n == node]
            missing = 0
            for key in keys:
                here = [r for r in holders[key] if replicas.nodes[r] == node]
                if here:
                    writers.add(here[0])
                    continue
                copies = holders[key]
                src, dst = copies[node % len(copies)], ranks[missing % len(ranks)]
                transfers.append(Transfer(stage=key[0], tp_rank=key[1], src=src, dst=dst))
                missing += 1
        return cls(
            replicas=replicas,
            places=places,
            writers=frozenset(writers),
            transfers=tuple(transfers),
            tp=tp,
            pp=pp,
        )

    def received_bytes(self, arch: ModelArch, dtype: torch.dtype, *, te_spec: bool):
        """Bytes each node receives from other nodes per sync: {node: bytes}, every node with an
        engine listed (0 when it holds every shard)."""
        out = {self.replicas.nodes[o]: 0 for o in self.replicas.owners}
        for t in self.transfers:
            items = sent_items(arch, stage=t.stage, tp_rank=t.tp_rank, pp=self.pp, te_spec=te_spec)
            numel = sum(torch.Size(shard_shape(item, arch, tp=self.tp)).numel() for item in items)
            out[self.replicas.nodes[t.dst]] += numel * torch.empty((), dtype=dtype).element_size()
        return out


def written_items(arch: ModelArch, *, stage: int, pp: int, te_spec: bool) -> list[StageParam]:
    """The parameters of `stage` whose HF tensors it writes: all but a tied output layer,
    whose HF tensor is the embedding that the first stage writes."""
    earlier = {
        name
        for before in range(stage)
        for item in stage_params(arch, pp_rank=before, pp=pp, te_spec=te_spec)
        for name in item.hf_names
    }
    return [
        item
        for item in stage_params(arch, pp_rank=stage, pp=pp, te_spec=te_spec)
        if not all(name in earlier for name in item.hf_names)
    ]


def sent_items(
    arch: ModelArch, *, stage: int, tp_rank: int, pp: int, te_spec: bool
) -> list[StageParam]:
    """The parameters of shard (stage, tp_rank) that land in the HF model: `written_items`
    less the replicated ones at tp_rank > 0 (tensor-parallel rank 0 writes those)."""
    items = written_items(arch, stage=stage, pp=pp, te_spec=te_spec)
    return [item for item in items if item.rule.tp_dim is not None or tp_rank == 0]


def shard_shape(item: StageParam, arch: ModelArch, *, tp: int) -> tuple[int, ...]:
    padded = padded_vocab_size(arch.vocab_size, tp=tp)
    return tuple(megatron_shape(item.rule, arch, tp=tp, padded_vocab=padded))
