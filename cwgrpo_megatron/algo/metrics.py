"""Training metrics as reducible parts (pure tensor code; no host syncs).

A metric is kept as a partial result that can be combined across micro-batches (`merge`) and
across ranks (`cwgrpo_megatron.comm.reduce_metrics`, one SUM and one MAX all-reduce for the
whole dict) before `finalize` turns it into values:

    kind "mean"  value = sum of x over tokens, count = number of tokens   -> value / count
    kind "min"   value = min of x                                          -> value
    kind "max"   value = max of x                                          -> value
    kind "sum"   value = a vector of sums (a histogram), count unused     -> `histograms`

Each metric is named as it is logged (`actor/...`, `cw/...`, `rollout/...`; docs/metrics.md).
Derived metrics (std, effective sample size, the top-1% covariance share) are computed by
`finalize` from the reduced parts, so that they too are global over the batch; the parts that
only feed them are `PARTS`.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from cwgrpo_megatron.algo.covariance import CovarianceStats

Metrics = dict[str, "Metric"]
# finalized, but only to derive others (cw/sigma, cw/ess, the histogram's sum of squares)
PARTS = frozenset({"cw/cov_sq_mean", "cw/w_sq_mean"})
# the top-1% shares `finalize` derives, and the prefix of the histogram each comes from
TOP_SHARES = {"cw/top1pct_cov_share": "cw/", "cw/eff_top1pct_cov_share": "cw/eff_"}


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
    one = values.new_ones((), dtype=torch.float64)
    if values.numel() == 0:
        return Metric(values.new_full((), fill, dtype=torch.float64), one, kind)
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
        elif mb.kind == "sum":
            out[name] = Metric(ma.value + mb.value, ma.count, "sum")
        elif mb.kind == "min":
            out[name] = Metric(torch.minimum(ma.value, mb.value), ma.count, "min")
        else:
            out[name] = Metric(torch.maximum(ma.value, mb.value), ma.count, "max")
    return out


def finalize(metrics: Metrics) -> dict[str, Tensor]:
    """Values of the (already reduced) metrics, plus derived ones; 0-d float64 tensors.

    Derived: cw/sigma = sqrt(E[c^2] - E[c]^2) from cw/cov_mean and cw/cov_sq_mean,
    cw/ess = ESS / N = (sum w~)^2 / (N sum w~^2) = 1 / E[w~^2] (w~ has mean one), and
    cw/top1pct_cov_share from the covariance histogram (`top_share`), and
    cw/eff_top1pct_cov_share from the weighted covariance's. Histograms themselves are left
    out: `histograms` returns them.
    """
    out = {}
    for name, m in metrics.items():
        if m.kind == "sum":
            continue
        out[name] = m.value / m.count.clamp(min=1.0) if m.kind == "mean" else m.value
    if "cw/cov_mean" in out and "cw/cov_sq_mean" in out:
        out["cw/sigma"] = (
            (out["cw/cov_sq_mean"] - out["cw/cov_mean"].square()).clamp(min=0.0).sqrt()
        )
    if "cw/w_sq_mean" in out:
        out["cw/ess"] = 1.0 / out["cw/w_sq_mean"].clamp(min=1e-30)
    for name, prefix in TOP_SHARES.items():
        counts, sums = metrics.get(f"{prefix}cov_hist_count"), metrics.get(f"{prefix}cov_hist_abs")
        if counts is not None and sums is not None:
            out[name] = top_share(counts.value, sums.value, 0.01)
    return out


def histograms(metrics: Metrics) -> dict[str, Tensor]:
    """The (already reduced) histogram parts of `metrics`, kind "sum", by name."""
    return {name: m.value for name, m in metrics.items() if m.kind == "sum"}


# Bins of the covariance histogram: |c| in [0, 1e-8), then 96 bins between log-spaced edges
# 1e-8 ... 1e4 (a factor of 10**0.125 = 1.33 each, values beyond 1e4 in the last), for each
# sign. Fixed edges need no min/max pass and sum exactly across ranks.
COV_ABS_EDGES = torch.logspace(-8, 4, 97, dtype=torch.float64)
COV_BINS = 2 * (len(COV_ABS_EDGES) - 1) + 1


def cov_bin_edges() -> Tensor:
    """`[COV_BINS + 1]` float64 edges of the signed histogram, ascending: -1e4 ... -1e-8,
    1e-8 ... 1e4 (the centre bin is (-1e-8, 1e-8); the outer bins also hold |c| > 1e4)."""
    return torch.cat([-COV_ABS_EDGES.flip(0), COV_ABS_EDGES])


def covariance_histogram(cov: Tensor, mask: Tensor, prefix: str = "cw/") -> Metrics:
    """Per-bin token counts and sums of |c| of the covariance `cov [b, s]` over the counted
    tokens (`mask [b, s]`), in the fixed bins of `cov_bin_edges`; `[COV_BINS]` float64 each,
    named `{prefix}cov_hist_count` and `{prefix}cov_hist_abs`."""
    counted = (mask.flatten() > 0).to(torch.float64)  # a weight, not an index: no host sync
    c = cov.detach().flatten().to(torch.float64)
    magnitude = c.abs()
    # 0 for |c| < 1e-8, else 1 + the log bin (clamped into the last one)
    ring = torch.bucketize(magnitude, COV_ABS_EDGES.to(c.device), right=True).clamp(
        max=len(COV_ABS_EDGES) - 1
    )
    centre = len(COV_ABS_EDGES) - 1
    index = torch.where(c < 0, centre - ring, centre + ring)
    counts = torch.zeros(COV_BINS, dtype=torch.float64, device=c.device)
    sums = torch.zeros_like(counts)
    counts.index_add_(0, index, counted)
    sums.index_add_(0, index, magnitude * counted)
    one = counts.new_ones(())
    return {
        f"{prefix}cov_hist_count": Metric(counts, one, "sum"),
        f"{prefix}cov_hist_abs": Metric(sums, one, "sum"),
    }


def top_share(counts: Tensor, abs_sums: Tensor, fraction: float) -> Tensor:
    """Share of sum |c| carried by the `fraction` of tokens of largest |c|, from the signed
    histogram `counts, abs_sums [COV_BINS]`.

    Bins are folded by |c| and taken from the top until fraction x N tokens; the bin where
    that count falls is taken pro rata (its tokens' |c| differ by at most the bin's factor of
    1.33, the only approximation). NaN when every c is 0 (every advantage at its pool's mean:
    no token carries any share).
    """
    centre = len(COV_ABS_EDGES) - 1
    fold_count = counts[centre:].clone()
    fold_abs = abs_sums[centre:].clone()
    fold_count[1:] += counts[:centre].flip(0)
    fold_abs[1:] += abs_sums[:centre].flip(0)
    count, mass = fold_count.flip(0), fold_abs.flip(0)  # largest |c| first
    wanted = fraction * count.sum()
    before = torch.cumsum(count, 0) - count  # tokens in the bins above each bin
    taken = (wanted - before).clamp(min=0.0).minimum(count)
    share = (taken / count.clamp(min=1.0) * mass).sum()
    total = mass.sum()
    return torch.where(total > 0, share / total.clamp(min=1e-300), float("nan"))


def covariance_metrics(stats: CovarianceStats, mask: Tensor) -> Metrics:
    """Mean and (via finalize) std of the centred covariance c over all counted tokens, from
    the local sums that the statistics pass already made, max |c|, and its histogram (via
    finalize, the share of sum |c| in the top 1% of tokens by |c|, the paper's "extreme
    tokens")."""
    count, cov_sum, cov_sq_sum = stats.local_sums.unbind()
    return {
        "cw/cov_mean": Metric(cov_sum, count, "mean"),
        "cw/cov_sq_mean": Metric(cov_sq_sum, count, "mean"),
        "cw/cov_abs_max": extreme_metric(stats.cov.abs(), mask, "max"),
        **covariance_histogram(stats.cov, mask),
    }


def effective_covariance_metrics(weights: Tensor, cov: Tensor, mask: Tensor) -> Metrics:
    """The covariance as the update sees it, c~ = w~ c (`weights`, `cov [b, s]`, both zero
    outside the mask): its mean cw/eff_cov_mean (the Cov(log pi, A) that drives the entropy
    change, with the advantages scaled by w~), max |c~| and its histogram (via finalize, the
    top-1% share cw/eff_top1pct_cov_share). With w~ = 1 (GRPO) they equal the cw/cov_* ones."""
    weighted = weights.to(cov.dtype) * cov
    return {
        "cw/eff_cov_mean": mean_metric(weighted, mask),
        "cw/eff_cov_abs_max": extreme_metric(weighted.abs(), mask, "max"),
        **covariance_histogram(weighted, mask, prefix="cw/eff_"),
    }


def weight_metrics(weights: Tensor, mask: Tensor) -> Metrics:
    """Fraction of tokens with w~ < 0.5, min / max of w~, and (via finalize) ESS of w.

    `weights [b, s]` is zero outside the mask and positive inside, as `kernel_weights` returns,
    which lets the count below 0.5, the max and the sum of squares skip the mask.
    """
    w = weights.detach().flatten()
    count = mask.to(torch.float64).sum()
    below = (w < 0.5).sum().to(torch.float64) - (w.numel() - count)
    top = w.amax().to(torch.float64) if w.numel() else w.new_zeros((), dtype=torch.float64)
    return {
        "cw/frac_w_below_half": Metric(below, count, "mean"),
        "cw/w_min": extreme_metric(weights, mask, "min"),
        "cw/w_max": Metric(torch.where(count > 0, top, float("-inf")), count.new_ones(()), "max"),
        "cw/w_sq_mean": Metric(torch.dot(w, w).to(torch.float64), count, "mean"),
    }
