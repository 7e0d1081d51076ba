"""Scopes: the pools of tokens over which covariance statistics are taken (pure tensor code).

A scope assigns every sequence (row) of the local batch to one of K pools (`segment [b]`) and
says how per-pool sums are completed across ranks (`reduce_sum`, identity for a local pool).
All three named scopes of DESIGN section 1 are instances:

    global       K = 1, every row in pool 0, sums reduced over the data-parallel group
    group        K = prompts, pool = prompt index; a group never spans ranks, so no reduction
    micro_batch  K = micro-batches, pool = micro-batch index; local (layout-dependent)

The constructors that attach collectives live in `cwgrpo_megatron.comm.scopes`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def _local(sums: Tensor) -> Tensor:
    return sums


@dataclass(frozen=True, eq=False)
class Scope:
    """`segment [b]` (int64 pool index per row), `num_segments` K, and `reduce_sum`, which
    turns this rank's per-pool sums `[K, j]` into the sums over every rank of the pool.

    `row_order [b]` (int64) is each row's position in the global batch, the same whatever the
    layout; selections that must break ties (kl_cov) order tokens by it. None means the local
    row order, which is the global one in a single process.
    """

    segment: Tensor
    num_segments: int
    reduce_sum: Callable[[Tensor], Tensor] = _local
    name: str = "local"
    row_order: Tensor | None = None

    def local_sums(self, *columns: Tensor) -> Tensor:
        """[K, j] float64: column j holds this rank's sum over each pool of `columns[j] [b, s]`
        (callers pass masked values). Rows are summed in float64, then scattered into pools:
        O(b s) reads and an O(b) scatter."""
        per_row = torch.stack([c.to(torch.float64).sum(dim=-1) for c in columns], dim=-1)
        pooled = per_row.new_zeros(self.num_segments, len(columns))
        return pooled.index_add_(0, self.segment, per_row)

    def sums(self, *columns: Tensor) -> Tensor:
        """`local_sums` completed over every rank of the pool: one `reduce_sum` call."""
        return self.reduce_sum(self.local_sums(*columns))

    def token_order(self, seq_len: int) -> Tensor:
        """`[b, s]` float64 global position row_order * s + t of each token: a total order of
        the tokens of every rank, exact while positions stay below 2**53. Every rank's rows
        must share the padded length s."""
        rows = self.row_order
        if rows is None:
            rows = torch.arange(self.segment.shape[0], device=self.segment.device)
        positions = torch.arange(seq_len, device=rows.device, dtype=torch.float64)
        return rows.to(torch.float64).unsqueeze(-1) * seq_len + positions

    def per_token(self, pool_values: Tensor) -> Tensor:
        """Broadcast `[K]` pool values to `[b, 1]`, ready to combine with `[b, s]` tensors."""
        return pool_values[self.segment].unsqueeze(-1)


def single_pool(batch_size: int, *, device: torch.device | str = "cpu") -> Scope:
    """Every local row in one pool, not reduced: the 1-process `global` scope."""
    return Scope(
        segment=torch.zeros(batch_size, dtype=torch.long, device=device),
        num_segments=1,
        name="global",
    )


def pools_from_index(index: Tensor, *, name: str, row_order: Tensor | None = None) -> Scope:
    """Local pools given by `index [b]` (e.g. prompt index or micro-batch index per row).

    Indices are relabelled to 0..K-1 so that any integer labels may be used.
    """
    labels, segment = torch.unique(index, return_inverse=True)
    return Scope(
        segment=segment.to(torch.long),
        num_segments=int(labels.numel()),
        name=name,
        row_order=row_order,
    )
