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


def mean_metric(values: Tensor, mask: Tensor, count: Tensor | None = None) -> Metric:
    """Token mean of `values [b, s]` over `mask [b, s]`, as (sum, count); the product is formed
    in the values' precision and summed in float64. Pass `count` to reuse the token count."""
    total = (values.detach() * mask).to(torch.float64).sum()
    if count is None:
        count = mask.to(torch.float64).sum()
    return Metric(total, count, "mean")


def extreme_metric(values: Tensor, mask: Tensor, kind: str) -> Metric:
    """Min or max of `values` over the masked tokens; +inf / -inf when there are none."""
    fill = float("inf") if kind == "min" else float("-inf")
    one = torch.ones((), dtype=torch.float64)
    if values.numel() == 0:
        return Metric(torch.tensor(fill, dtype=torch.float64), one, kind)
    masked = values.detach().masked_fill(mask <= 0, fill)
    reduced = masked.amin() if kind == "min" else masked.amax()
    return Metric(reduced.to(torch.float64), one, kind)


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


def covariance_metrics(stats: CovarianceStats) -> Metrics:
    """Mean and (via finalize) std of the centred covariance c over all counted tokens, from
    the local sums that the statistics pass already made (no extra pass over the tokens)."""
    count, cov_sum, cov_sq_sum = stats.local_sums.unbind()
    return {
        "cov_mean": Metric(cov_sum, count, "mean"),
        "cov_sq_mean": Metric(cov_sq_sum, count, "mean"),
    }


def weight_metrics(weights: Tensor, mask: Tensor) -> Metrics:
    """Fraction of tokens with w~ < 0.5, min / max of w~, and (via finalize) ESS of w.

    `weights [b, s]` is zero outside the mask and positive inside, as `kernel_weights` returns,
    which lets the count below 0.5, the max and the sum of squares skip the mask.
    """
    w = weights.detach().flatten()
    count = mask.to(torch.float64).sum()
    below = (w < 0.5).sum().to(torch.float64) - (w.numel() - count)
    top = w.amax().to(torch.float64) if w.numel() else torch.zeros((), dtype=torch.float64)
    return {
        "weight_frac_below_half": Metric(below, count, "mean"),
        "weight_min": extreme_metric(weights, mask, "min"),
        "weight_max": Metric(torch.where(count > 0, top, float("-inf")), count.new_ones(()), "max"),
        "weight_sq_mean": Metric(torch.dot(w, w).to(torch.float64), count, "mean"),
    }
