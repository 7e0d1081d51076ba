"""Sampling metrics of one problem with n samples of which c are correct (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

PASS_KS = (2, 4, 8, 16)
"""The k of pass@k reported beside pass@1 (avg@n) and pass@n, where k < n."""
DISTINCT = "distinct_answers"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), for 1 <= k <= n.

    pass@1 is the mean correctness (avg@n); pass@n is 1 if any sample is correct.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def reported_ks(n: int) -> list[int]:
    """The k of pass@k a summary of n samples per problem reports: `PASS_KS` below n, then n."""
    return [k for k in PASS_KS if k < n] + [n]


def summary_keys(n: int) -> list[str]:
    """The rate keys of a benchmark's summary, in order: avg@n, pass@k (`reported_ks`), and
    distinct_answers (the mean number of distinct final answers among a problem's n samples)."""
    return [f"avg@{n}", *(f"pass@{k}" for k in reported_ks(n)), DISTINCT]


def distinct_answers(answers: Sequence[str | None]) -> int:
    """How many different final answers a problem's samples gave; a sample without one (None)
    adds none."""
    return len({a for a in answers if a is not None})
