"""Where the rollout engines live and which prompts each one samples (`rollout.replicas`).

The job's ranks are split into replica groups of consecutive ranks inside a node (a node is
what torchrun calls one: its `GROUP_RANK`); the first rank of a group owns the group's engine.
`per_node` gives one group per node; an integer R gives R / nodes groups per node, or, with
fewer replicas than nodes, one on each of the first R nodes (R = 1: one engine, on rank 0).

A step's P prompts are split into R contiguous shares, one per replica, by position:

    replica r samples positions [r P // R, (r + 1) P // R)

The owner generates its share and scores it; one all-gather then gives every rank the whole
step (`components.rollouts.Rollouts.score`). Every rank already holds the step's prompts (the
sampler is the same on every rank), so nothing is sent to an engine, and the shares do not
depend on the data-parallel layout: with pipeline stages on other nodes every replica still
works. Sampling seeds are a function of (seed, step, position) (`rollout.base.rollout_seed`),
so the completions do not depend on the number of replicas either.

With separate placement on GPUs (`rollout.placement=separate`, `engine_gpus` > 0) the engines
hold GPUs of their own: a node's trainer ranks use its first GPUs (LOCAL_RANK), and its
engine_gpus / engine_tp engines the next ones, one engine per replica group of its ranks.

Pure bookkeeping: the node of every rank comes from `comm.node_of_each_rank`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Replicas:
    nodes: tuple[int, ...]
    """The node of every global rank (0, 1, ... in order of first appearance)."""
    groups: tuple[tuple[int, ...], ...]
    """The global ranks of each replica, in replica order; the first one owns the engine."""
    engine_tp: int = 1
    """The engine's tensor-parallel size (`rollout.tp`)."""
    separate: bool = False
    """The engines' GPUs come after the trainer's on each node (separate placement)."""

    @classmethod
    def place(
        cls,
        nodes: Sequence[Hashable],
        replicas: int | str,
        *,
        engine_tp: int = 1,
        cuda: bool = False,
        engine_gpus: int = 0,
    ) -> Replicas:
        """Replica groups for ranks on `nodes` (the node id of each global rank, any labels):
        `replicas` R auto (with `cuda`, one per `engine_tp` consecutive ranks, i.e. GPUs, of
        every node; else per_node), per_node, R >= nodes (R / nodes on each node) or R < nodes
        (one on each of the first R nodes; the others hold no engine). ValueError when R cannot
        be split evenly, or a group would have fewer ranks than the engine's tensor-parallel
        size. `engine_gpus` > 0 (with `cuda`): separate placement, `engine_gpus / engine_tp`
        engines per node on GPUs after the trainer's."""
        order = list(dict.fromkeys(nodes))
        index = tuple(order.index(n) for n in nodes)
        members = [[r for r, n in enumerate(index) if n == node] for node in range(len(order))]
        separate = cuda and engine_gpus > 0
        if separate:
            if engine_gpus % engine_tp:
                raise ValueError(
                    f"rollout.gpus_per_node={engine_gpus} does not split into engines of "
                    f"rollout.tp={engine_tp} GPUs: use a multiple of it"
                )
            if replicas != "auto":
                raise ValueError(
                    "with rollout.placement=separate the engines are one per rollout.tp of "
                    "rollout.gpus_per_node on every node: leave rollout.replicas at auto"
                )
            replicas = len(order) * (engine_gpus // engine_tp)
        # a colocated engine runs on its first ranks' GPUs; a separate one needs one rank
        min_ranks = 1 if separate else engine_tp
        if replicas == "auto" and cuda:
            uneven = [len(m) for m in members if len(m) % engine_tp]
            if uneven:
                raise ValueError(
                    f"a node of {uneven[0]} GPUs does not split into engines of "
                    f"rollout.tp={engine_tp} GPUs: set rollout.tp to a divisor of it"
                )
            replicas = sum(len(m) for m in members) // engine_tp
        count = len(order) if replicas in ("auto", "per_node") else int(replicas)
        if count > len(order) and count % len(order):
            raise ValueError(
                f"rollout.replicas={replicas} does not split over {len(order)} nodes: use a "
                "multiple of the node count, fewer replicas than nodes, or per_node"
            )
        per_node = max(1, count // len(order))
        groups = []
        for node, ranks in enumerate(members[:count]):
            if len(ranks) % per_node:
                raise ValueError(
                    f"node {node} has {len(ranks)} ranks, which do not split into {per_node} "
                    f"replicas: set rollout.replicas to a divisor of {len(ranks)} per node"
                )
            size = len(ranks) // per_node
            if size < min_ranks:
                raise ValueError(
                    f"a replica of {size} ranks cannot hold an engine at rollout.tp={engine_tp}: "
                    "lower rollout.tp or rollout.replicas"
                )
            groups += [tuple(ranks[i : i + size]) for i in range(0, len(ranks), size)]
        return cls(nodes=index, groups=tuple(groups), engine_tp=engine_tp, separate=separate)

    @classmethod
    def single(cls, world_size: int = 1) -> Replicas:
        """One engine on rank 0 and every rank on one node (one-node tools and tests)."""
        return cls(nodes=(0,) * world_size, groups=(tuple(range(world_size)),))

    @property
    def owners(self) -> tuple[int, ...]:
        return tuple(group[0] for group in self.groups)

    def owned_by(self, rank: int) -> int | None:
        """The replica whose engine `rank` owns; None for a rank that owns none."""
        return self.owners.index(rank) if rank in self.owners else None

    def owners_on(self, node: int) -> tuple[int, ...]:
        return tuple(o for o in self.owners if self.nodes[o] == node)

    def share(self, replica: int, prompts: int) -> range:
        """The positions of a step's `prompts` that `replica` samples."""
        count = len(self.groups)
        return range(replica * prompts // count, (replica + 1) * prompts // count)

    def local_index(self, rank: int) -> int:
        """`rank`'s place among its node's ranks: its LOCAL_RANK, and so its GPU."""
        return [r for r, n in enumerate(self.nodes) if n == self.nodes[rank]].index(rank)

    def devices(self, replica: int) -> list[int]:
        """The local device indices (LOCAL_RANK) of the engine's `engine_tp` GPUs: the first
        ranks of its group, counted from the start of its node; with separate placement the
        GPUs after the node's trainer ranks, engine by engine."""
        owner = self.groups[replica][0]
        if self.separate:
            node = self.nodes[owner]
            ranks = sum(1 for n in self.nodes if n == node)
            first = ranks + self.owners_on(node).index(owner) * self.engine_tp
            return list(range(first, first + self.engine_tp))
        local = self.local_index(owner)
        return list(range(local, local + self.engine_tp))

    def shares_gpu(self, rank: int) -> bool:
        """Does an engine run on `rank`'s GPU?"""
        if self.separate:
            return False
        node = self.nodes[rank]
        used = {d for r in range(len(self.groups)) if self.nodes[self.groups[r][0]] == node
                for d in self.devices(r)}  # fmt: skip
        return self.local_index(rank) in used
