"""Generation when only some ranks own an engine: prompts go to the owner, results come back.

Every rank of `group` calls `generate` with its own prompts (whole prompt groups of its DP
shard). The owner gathers them (one gather of Python objects over `group`), generates all in one
engine call, and scatters each rank's groups back (one scatter). An error on the owner (bad
input, say) is scattered too and raised on every rank, so no rank waits forever.
"""

from __future__ import annotations

from collections.abc import Sequence

from cwgrpo_megatron.dist.collectives import Group, gather_objects, scatter_objects
from cwgrpo_megatron.rollout.base import RolloutEngine, RolloutGroup, SamplingConfig


class RemoteRolloutError(RuntimeError):
    pass


class DistributedRollout:
    def __init__(self, engine: RolloutEngine | None, *, owner: int = 0, group: Group = None):
        """`engine` on global rank `owner`, None on the other ranks of `group` (the ranks that
        share it, e.g. `dist.group.WORLD`; None means this process alone)."""
        import torch.distributed as dist

        here = dist.get_rank() if dist.is_initialized() else 0
        if (engine is not None) != (here == owner):
            raise ValueError(f"exactly global rank {owner} must hold the engine (rank {here})")
        self.engine, self.owner, self.group = engine, owner, group

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutGroup]:
        """This rank's groups; a rank may send no prompts (it gets []). With `seeds` (one per
        prompt, on every rank or on none) each prompt keeps its own seed in the joint call."""
        request = ([list(p) for p in prompt_token_ids], None if seeds is None else list(seeds))
        per_rank = gather_objects(request, self.owner, self.group)
        parts = None
        if per_rank is not None:
            try:
                flat = [p for prompts, _ in per_rank for p in prompts]
                flat_seeds = None if seeds is None else [s for _, ss in per_rank for s in ss]
                groups = self.engine.generate(flat, n, sampling, seeds=flat_seeds)
                parts, start = [], 0
                for prompts, _ in per_rank:
                    parts.append(groups[start : start + len(prompts)])
                    start += len(prompts)
            except Exception as exc:  # every rank must learn of it, not only the owner
                parts = [exc] * len(per_rank)
        mine = scatter_objects(parts, self.owner, self.group)
        if isinstance(mine, Exception):
            if self.engine is not None:
                raise mine
            raise RemoteRolloutError(f"rollout failed on rank {self.owner}: {mine}") from mine
        return mine
