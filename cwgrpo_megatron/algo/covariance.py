"""Covariance statistics and Gaussian-kernel token weights of CW-GRPO (pure tensor code).

Over a scope S of tokens (see `scope.py`), with token mask m, log-prob l and advantage A:

    N      = sum_S m
    l_bar  = sum_S m*l / N,     A_bar = sum_S m*A / N
    c_it   = (l_it - l_bar) * (A_it - A_bar)
    sigma  = population std of c over S
    w_it   = exp(-c_it^2 / (2 sigma^2))          (w = 1 when sigma == 0)
    w~_it  = w_it * N / sum_S m*w                (mean one over S; a constant, no gradient)

Communication: exactly three `scope.reduce_sum` calls, each of at most 3 scalars per pool:
(N, sum l, sum A), (sum c, sum c^2), (sum w). With the global scope each is one all-reduce
over the data-parallel group; sums are float64.

Numerics: the kernel is evaluated as exp(-(c^2 - s)/(2 sigma^2)) with a per-pool shift
s = max(0, |c_bar| - sigma*sqrt(N))^2. Every token has |c - c_bar| <= sigma*sqrt(N), so
c^2 >= s: no term exceeds 1, and the shift cancels in w~. Only when c is so nearly constant that
the kernel underflows on every token of a pool (|c| > ~38 sigma everywhere) is sum w zero; that
pool then falls back to w~ = 1, the sigma == 0 rule, instead of 0/0.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from cwgrpo_megatron.algo.scope import Scope


class CovarianceStats(NamedTuple):
    """Per-pool statistics `[K]` (float64) and the per-token covariance `cov [b, s]`."""

    count: Tensor
    logp_mean: Tensor
    adv_mean: Tensor
    cov: Tensor
    cov_mean: Tensor
    cov_std: Tensor


def centred_covariance(logp: Tensor, adv: Tensor, mask: Tensor, scope: Scope) -> CovarianceStats:
    """c = (l - l_bar)(A - A_bar) over the scope; `logp, adv, mask [b, s]` (detached inputs).

    Two `scope.reduce_sum` calls: (N, sum l, sum A) then (sum c, sum c^2).
    """
    logp = logp.detach().to(torch.float64)
    adv = adv.detach().to(torch.float64)
    m = mask.to(torch.float64)
    first = scope.sums(m, torch.ones_like(logp), logp, adv)
    count = first[:, 0]
    safe_count = count.clamp(min=1.0)
    logp_mean = first[:, 1] / safe_count
    adv_mean = first[:, 2] / safe_count
    cov = (logp - scope.per_token(logp_mean)) * (adv - scope.per_token(adv_mean)) * m
    second = scope.sums(m, cov, cov * cov)
    cov_mean = second[:, 0] / safe_count
    cov_var = (second[:, 1] / safe_count - cov_mean * cov_mean).clamp(min=0.0)
    return CovarianceStats(count, logp_mean, adv_mean, cov, cov_mean, cov_var.sqrt())


def kernel_weights(stats: CovarianceStats, mask: Tensor, scope: Scope) -> Tensor:
    """w~ `[b, s]` float32 from `centred_covariance` output; zero where mask == 0.

    One `scope.reduce_sum` call: (sum w).
    """
    m = mask.to(torch.float64)
    sigma = stats.cov_std
    degenerate = sigma == 0
    two_var = torch.where(degenerate, torch.ones_like(sigma), 2.0 * sigma * sigma)
    shift = (stats.cov_mean.abs() - sigma * stats.count.sqrt()).clamp(min=0.0).square()
    # Masked tokens are outside the pool, where c^2 >= s need not hold: zero their exponent.
    exponent = (stats.cov.square() - scope.per_token(shift)) / scope.per_token(two_var) * m
    w = torch.where(scope.per_token(degenerate), torch.ones_like(exponent), torch.exp(-exponent))
    w_sum = scope.sums(m, w)[:, 0]
    underflow = w_sum <= 0
    scale = stats.count / torch.where(underflow, torch.ones_like(w_sum), w_sum)
    weights = torch.where(
        scope.per_token(underflow), torch.ones_like(w), w * scope.per_token(scale)
    )
    return (weights * m).to(torch.float32)


def covariance_weights(
    logp: Tensor, adv: Tensor, mask: Tensor, scope: Scope
) -> tuple[Tensor, CovarianceStats]:
    """CW-GRPO weights w~ `[b, s]` and the statistics they came from (3 `reduce_sum` calls)."""
    stats = centred_covariance(logp, adv, mask, scope)
    return kernel_weights(stats, mask, scope), stats
