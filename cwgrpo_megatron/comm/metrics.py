"""Reduce a metrics dict over a group with two all-reduces (SUM for means and histograms, MAX
for extremes)."""

import torch

from cwgrpo_megatron.algo.metrics import Metric, Metrics
from cwgrpo_megatron.comm.collectives import Group, max_over, sum_over


def reduce_metrics(metrics: Metrics, *, group: Group = None) -> Metrics:
    """Global metrics: mean-type (sum, count) pairs and histograms summed, min/max combined,
    over `group`.

    Every rank must pass the same metric names (in any order); names are sorted so that the
    packed vectors line up.
    """
    names = sorted(metrics)
    means = [n for n in names if metrics[n].kind == "mean"]
    vectors = [n for n in names if metrics[n].kind == "sum"]
    extremes = [n for n in names if metrics[n].kind in ("min", "max")]
    out: Metrics = {}
    if means or vectors:
        parts = [metrics[n].value.to(torch.float64).view(1) for n in means]
        parts += [metrics[n].count.to(torch.float64).view(1) for n in means]
        parts += [metrics[n].value.to(torch.float64).flatten() for n in vectors]
        total = sum_over(torch.cat(parts), group)
        for i, n in enumerate(means):
            out[n] = Metric(total[i], total[len(means) + i], "mean")
        offset = 2 * len(means)
        for n in vectors:
            size = metrics[n].value.numel()
            value = total[offset : offset + size].view_as(metrics[n].value)
            out[n] = Metric(value, metrics[n].count, "sum")
            offset += size
    if extremes:
        packed = torch.stack([metrics[n].value.to(torch.float64) for n in extremes])
        # on the values' device: a host constant would stop the product on a GPU
        signs = packed.new_tensor([-1.0 if metrics[n].kind == "min" else 1.0 for n in extremes])
        packed = packed * signs
        total = max_over(packed, group) * signs
        for i, n in enumerate(extremes):
            out[n] = Metric(total[i], metrics[n].count, metrics[n].kind)
    return out
