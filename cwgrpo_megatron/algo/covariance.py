"""Covariance statistics and Gaussian-kernel token weights of CW-GRPO (pure tensor code).

Over a scope S of tokens (see `scope.py`), with token mask m, log-prob l and advantage A:

    N      = sum_S m
    l_bar  = sum_S m*l / N,     A_bar = sum_S m*A / N
    c_it   = (l_it - l_bar) * (A_it - A_bar)
    sigma  = population std of c over S
    w_it   = exp(-c_it^2 / (2 sigma^2))          (w = 1 when sigma == 0)

A centred value within the mean's rounding, |x - x_bar| <= 2 N eps |x_bar| with float64's eps,
counts as 0: a pool whose advantages (or log-probs) are all equal has c = 0 and w = 1, as in
exact arithmetic (`_centred`).
    w~_it  = w_it * N / sum_S m*w                (mean one over S; a constant, no gradient)

Communication: exactly three `scope.reduce_sum` calls, each of at most 3 scalars per pool:
(N, sum l, sum A), (sum c, sum c^2), (sum w). With the global scope each is one all-reduce
over the data-parallel group; sums are float64.

Numerics: the kernel is evaluated as exp(-(c^2 - s)/(2 sigma^2)) with a per-pool shift
s = max(0, |c_bar| - sigma*sqrt(N))^2. Every token has |c - c_bar| <= sigma*sqrt(N), so
c^2 >= s: no term exceeds 1, and the shift cancels in w~. It keeps the kernel representable
when |c_bar| >> sigma, where the unshifted terms would all underflow. Only when c is so nearly
constant that (c^2 - s) / (2 sigma^2) > ~745 on every token of a pool is sum w still zero; that
pool then falls back to w~ = 1, the sigma == 0 rule, instead of 0/0.

Precision: per-token values are computed in the inputs' precision (at least fp32); every sum
is accumulated in float64. The statistics need c^2 to be representable: with fp64 inputs,
|c| above ~1e-150 (GRPO's log-probs and advantages are 0 or far larger).
"""

from typing import NamedTuple

import torch
from torch import Tensor

from cwgrpo_megatron.algo.scope import Scope


class CovarianceStats(NamedTuple):
    """Per-pool statistics `[K]` (float64); the per-token covariance `cov [b, s]` and its
    square `cov_sq` (compute dtype, zero outside the mask); and `local_sums [3]`, this rank's
    own (tokens, sum c, sum c^2), for metrics that are reduced later."""

    count: Tensor
    logp_mean: Tensor
    adv_mean: Tensor
    cov: Tensor
    cov_sq: Tensor
    cov_mean: Tensor
    cov_std: Tensor
    local_sums: Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    """Per-token math runs in fp32 (fp64 inputs stay fp64); every sum is float64."""
    return torch.promote_types(t.dtype, torch.float32)


def centred_covariance(logp: Tensor, adv: Tensor, mask: Tensor, scope: Scope) -> CovarianceStats:
    """c = (l - l_bar)(A - A_bar) over the scope; `logp, adv, mask [b, s]` (detached inputs).

    Two `scope.reduce_sum` calls: (N, sum l, sum A) then (sum c, sum c^2).
    """
    dtype = compute_dtype(logp)
    logp = logp.detach().to(dtype)
    adv = adv.detach().to(dtype)
    m = mask.to(dtype)
    first_local = scope.local_sums(m, logp * m, adv * m)
    first = scope.reduce_sum(first_local)
    count = first[:, 0]
    safe_count = count.clamp(min=1.0)
    logp_mean = first[:, 1] / safe_count
    adv_mean = first[:, 2] / safe_count
    cov = _centred(logp, logp_mean, count, scope) * _centred(adv, adv_mean, count, scope)
    cov.mul_(m)
    cov_sq = cov.square()
    second_local = scope.local_sums(cov, cov_sq)
    second = scope.reduce_sum(second_local)
    cov_mean = second[:, 0] / safe_count
    cov_var = (second[:, 1] / safe_count - cov_mean * cov_mean).clamp(min=0.0)
    local_sums = torch.cat([first_local[:, 0].sum().view(1), second_local.sum(dim=0)])
    return CovarianceStats(
        count, logp_mean, adv_mean, cov, cov_sq, cov_mean, cov_var.sqrt(), local_sums
    )


def _centred(x: Tensor, mean: Tensor, count: Tensor, scope: Scope) -> Tensor:
    """x - x_bar, with differences within the mean's rounding (|x - x_bar| <= 2 N eps |x_bar|,
    eps of float64, where the sums are taken) set to 0: a pool of equal advantages (or equal
    log-probs) has c = 0 exactly, and rounding would otherwise make c a scaled copy of the other
    factor, and the kernel a Gaussian of it instead of w = 1."""
    floor = scope.per_token(2 * count * torch.finfo(torch.float64).eps * mean.abs()).to(x.dtype)
    centred = x - scope.per_token(mean).to(x.dtype)
    return centred.masked_fill_(centred.abs() <= floor, 0.0)


def kernel_weights(stats: CovarianceStats, mask: Tensor, scope: Scope) -> Tensor:
    """w~ `[b, s]` float32 from `centred_covariance` output; zero where mask == 0.

    One `scope.reduce_sum` call: (sum w).
    """
    dtype = stats.cov.dtype
    sigma = stats.cov_std
    inv_two_var = torch.where(sigma == 0, 0.0, 0.5 / (sigma * sigma).clamp(min=1e-300))
    shift = (stats.cov_mean.abs() - sigma * stats.count.sqrt()).clamp(min=0.0).square()
    # exponent = (c^2 - s) / (2 sigma^2): 0 (w = 1) where sigma == 0, and +inf (w = 0) outside
    # the mask, where c^2 >= s need not hold.
    exponent = stats.cov_sq - scope.per_token(shift).to(dtype)
    exponent.mul_(scope.per_token(inv_two_var).to(dtype)).masked_fill_(mask <= 0, float("inf"))
    w = torch.exp(exponent.neg_())
    w_sum = scope.sums(w)[:, 0]
    # A pool whose kernel underflowed everywhere falls back to w~ = 1 (the sigma == 0 rule).
    underflow = w_sum <= 0
    scale = torch.where(underflow, 0.0, stats.count / torch.where(underflow, 1.0, w_sum))
    fallback = underflow.to(dtype)
    weights = torch.addcmul(
        w * scope.per_token(scale).to(dtype), scope.per_token(fallback), mask.to(dtype)
    )
    return weights.to(torch.float32)


def covariance_weights(
    logp: Tensor, adv: Tensor, mask: Tensor, scope: Scope
) -> tuple[Tensor, CovarianceStats]:
    """CW-GRPO weights w~ `[b, s]` and the statistics they came from (3 `reduce_sum` calls)."""
    stats = centred_covariance(logp, adv, mask, scope)
    return kernel_weights(stats, mask, scope), stats
