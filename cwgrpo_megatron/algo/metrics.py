"""Training metrics as reducible parts (pure tensor code; no host syncs).

A metric is kept as a partial result that can be combined across micro-batches (`merge`) and
across ranks (`cwgrpo_megatron.dist.reduce_metrics`, one SUM and one MAX all-reduce for the
whole dict) before `finalize` turns it into values:

    kind "mean"  value = sum of x over tokens, count = number of tokens   -> value / count
    kind "min"   value = min of x                                          -> value
    kind "max"   value = max of x                                          -> value

Derived metrics (std, effective sample size) are computed by `finalize` from mean-type parts,
so that they too are exact over the global batch.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from cwgrpo_megatron.algo.covariance import CovarianceStats

Metrics = dict[str, "Metric"]


class Metric(NamedTuple):
    value: Tensor
    count: Tensor
    kind: str


def mean_metric(values: Tensor, mask: Tensor) -> Metric:
    """Token mean of `values [b, s]` over `mask [b, s]`, as (sum, count)."""
    m = mask.to(torch.float64)
    return Metric((values.detach().to(torch.float64) * m).sum(), m.sum(), "mean")


def extreme_metric(values: Tensor, mask: Tensor, kind: str) -> Metric:
    """Min or max of `values` over the masked tokens; +inf / -inf when there are none."""
    fill = float("inf") if kind == "min" else float("-inf")
    masked = torch.where(mask > 0, values.detach().to(torch.float64), fill)
    reduced = masked.min() if kind == "min" else masked.max()
    if masked.numel() == 0:
        reduced = torch.tensor(fill, dtype=torch.float64)
    return Metric(reduced, torch.ones((), dtype=torch.float64), kind)


def merge(a: Metrics, b: Metrics) -> Metrics:
    """Combine the metrics of two disjoint token sets (e.g. two micro-batches)."""
    out = dict(a)
    for name, mb in b.items():
        ma = out.get(name)
        if ma is None:
            out[name] = mb
        elif mb.kind == "mean":
            out[name] = Metric(ma.value + mb.value, ma.count + mb.count, "mean")
        elif mb.kind == "min":
            out[name] = Metric(torch.minimum(ma.value, mb.value), ma.count, "min")
        else:
            out[name] = Metric(torch.maximum(ma.value, mb.value), ma.count, "max")
    return out


def finalize(metrics: Metrics) -> dict[str, Tensor]:
    """Values of the (already reduced) metrics, plus derived ones; 0-d float64 tensors.

    Derived: cov_std = sqrt(E[c^2] - E[c]^2) from cov_mean / cov_sq_mean, and
    weight_ess_frac = ESS / N = (sum w~)^2 / (N sum w~^2) = 1 / E[w~^2] (w~ has mean one).
    """
    out = {}
    for name, m in metrics.items():
        out[name] = m.value / m.count.clamp(min=1.0) if m.kind == "mean" else m.value
    if "cov_mean" in out and "cov_sq_mean" in out:
        out["cov_std"] = (out["cov_sq_mean"] - out["cov_mean"].square()).clamp(min=0.0).sqrt()
    if "weight_sq_mean" in out:
        out["weight_ess_frac"] = 1.0 / out["weight_sq_mean"].clamp(min=1e-30)
    return out


def covariance_metrics(stats: CovarianceStats, mask: Tensor) -> Metrics:
    """Mean and (via finalize) std of the centred covariance c over all counted tokens."""
    return {
        "cov_mean": mean_metric(stats.cov, mask),
        "cov_sq_mean": mean_metric(stats.cov.square(), mask),
    }


def weight_metrics(weights: Tensor, mask: Tensor) -> Metrics:
    """Fraction of tokens with w~ < 0.5, min / max of w~, and (via finalize) ESS of w."""
    return {
        "weight_frac_below_half": mean_metric((weights < 0.5).to(torch.float64), mask),
        "weight_min": extreme_metric(weights, mask, "min"),
        "weight_max": extreme_metric(weights, mask, "max"),
        "weight_sq_mean": mean_metric(weights.to(torch.float64).square(), mask),
    }
