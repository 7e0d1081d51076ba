"""Sampling metrics of one problem with n samples of which c are correct (pure)."""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), for 1 <= k <= n.

    pass@1 is the mean correctness (avg@n); pass@n is 1 if any sample is correct.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)
