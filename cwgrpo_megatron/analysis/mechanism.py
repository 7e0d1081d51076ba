"""The paper's mechanism and the policy's diversity, read from runs' metrics.jsonl.

The entropy mechanism (Cui et al. 2025, on which CW-GRPO rests): a policy-gradient step changes
the entropy by about -eta Cov(log pi, A) over the batch's tokens. Per run, at every step k with
a probe measurement after it (`run.probe_groups`):

    dH_k     probe/entropy_{k+1} - probe/entropy_k: the change step k's update made, on fixed
             sequences (no sampling noise); probe/entropy_k is measured before step k's update
    Cov_k    the covariance the update saw: cw/eff_cov_mean, mean of w~ c (CW-GRPO), else
             cw/cov_mean (GRPO: w~ = 1); raw Cov_k is cw/cov_mean for every method
    slope    the least-squares slope of dH on Cov (the theory says negative, -eta)
    corr     Pearson's r of dH and Cov, and of dH and the raw covariance

The tails (over steps with a signal, cw/sigma > 0): the mean top-1% share of sum |c| and the
mean max |c|, of c and of the weighted w~ c.

Diversity at matched accuracy: per held-out evaluation point, pass@K (K the largest k logged)
and distinct answers, binned by that point's avg@n (ACCURACY_BINS), so that methods are compared
at the same pass@1 and not at the same step.

A group of runs is reported as mean +- std over its runs (ddof = 1), as `run_compare` does.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from cwgrpo_megatron.analysis.run_compare import Run, groups_of
from cwgrpo_megatron.common.files import save_figure

ACCURACY_BINS = ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.01))
MIN_POINTS = 3
"""Steps a run needs for a slope and a correlation."""


def effective_key(run: Run) -> str:
    """The metric of the covariance run's update saw: cw/eff_cov_mean where logged (CW-GRPO's
    w~ c), else cw/cov_mean (w~ = 1)."""
    return "cw/eff_cov_mean" if run.series("cw/eff_cov_mean")[0] else "cw/cov_mean"


def entropy_changes(run: Run) -> dict[int, float]:
    """step k -> probe/entropy_{k+1} - probe/entropy_k, where both steps logged it."""
    h = dict(zip(*run.series("probe/entropy"), strict=True))
    return {k: h[k + 1] - h[k] for k in sorted(h) if k + 1 in h}


def mechanism_points(run: Run, key: str | None = None) -> tuple[list[float], list[float]]:
    """(Cov_k, dH_k) at the steps with both; `key` the covariance metric (default:
    `effective_key`)."""
    cov = dict(zip(*run.series(key or effective_key(run)), strict=True))
    changes = entropy_changes(run)
    steps = [k for k in changes if k in cov]
    return [cov[k] for k in steps], [changes[k] for k in steps]


def fit(x: Sequence[float], y: Sequence[float]) -> tuple[float | None, float | None]:
    """(least-squares slope of y on x, Pearson's r); None where fewer than MIN_POINTS points
    or a series is constant."""
    if len(x) < MIN_POINTS:
        return None, None
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    if sxx == 0:
        return None, None
    return sxy / sxx, (sxy / math.sqrt(sxx * syy) if syy > 0 else None)


def _mean(run: Run, key: str) -> float | None:
    """Mean of `key` over its steps (for the tails, those with a signal: `SIGNAL_ONLY`)."""
    values = run.series(key)[1]
    return statistics.fmean(values) if values else None


def mechanism_stats(run: Run) -> dict[str, float | None]:
    """The module docstring's per-run figures, by name."""
    key = effective_key(run)
    slope, corr = fit(*mechanism_points(run, key))
    _, raw_corr = fit(*mechanism_points(run, "cw/cov_mean"))
    weighted = key.removesuffix("cov_mean")  # cw/eff_ or cw/
    return {
        "steps with dH": len(entropy_changes(run)) or None,
        "slope dH / Cov": slope,
        "corr(dH, Cov)": corr,
        "corr(dH, raw Cov)": raw_corr,
        "top-1% share of abs c": _mean(run, "cw/top1pct_cov_share"),
        "top-1% share of abs w~ c": _mean(run, f"{weighted}top1pct_cov_share"),
        "max abs c": _mean(run, "cw/cov_abs_max"),
        "max abs w~ c": _mean(run, f"{weighted}cov_abs_max"),
    }


def top_pass_key(run: Run) -> str | None:
    """eval/heldout/pass@K for the largest K the run logged, or None."""
    ks = {int(m.group(1)) for line in run.lines for name in line
          if (m := re.fullmatch(r"eval/heldout/pass@(\d+)", name))}  # fmt: skip
    return f"eval/heldout/pass@{max(ks)}" if ks else None


def diversity_stats(run: Run) -> dict[str, float | None]:
    """Mean pass@K and distinct answers over the evaluation points whose held-out avg@n lies in
    each ACCURACY_BINS bin (the last bin includes 1)."""
    accuracy = dict(zip(*run.series("eval/heldout/avg@*"), strict=True))
    key = top_pass_key(run)
    out: dict[str, float | None] = {}
    if key is None:
        return out
    name = key.rsplit("/", 1)[-1]
    for metric, label in ((key, name), ("eval/heldout/distinct_answers", "distinct answers")):
        values = dict(zip(*run.series(metric), strict=True))
        for lo, hi in ACCURACY_BINS:
            inside = [values[s] for s, a in accuracy.items() if lo <= a < hi and s in values]
            out[f"{label} at avg {lo:.1f}-{min(hi, 1.0):.1f}"] = (
                statistics.fmean(inside) if inside else None
            )
    return out


def _cell(values: list[float], runs: int) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    cell = f"{statistics.fmean(values):.3g} ± {std:.2g}"
    return cell + (f" ({len(values)} of {runs})" if len(values) < runs else "")


def mechanism_table(runs: Sequence[Run]) -> str:
    """Markdown: one row per statistic, one column per group, mean +- std over its runs."""
    groups = groups_of(runs)
    per_group = {g: [{**mechanism_stats(r), **diversity_stats(r)} for r in members]
                 for g, members in groups.items()}  # fmt: skip
    names = list(dict.fromkeys(n for stats in per_group.values() for s in stats for n in s))
    lines = [
        "### The mechanism and diversity (mean ± std over runs)",
        "",
        "| statistic | " + " | ".join(f"{g} ({len(m)})" for g, m in groups.items()) + " |",
        "|---|" + "---|" * len(groups),
    ]
    for name in names:
        cells = [
            _cell([s[name] for s in stats if s.get(name) is not None], len(stats))
            for stats in per_group.values()
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def plot_mechanism(runs: Sequence[Run], out: Path) -> Path:
    """Three panels: dH against Cov per run (a line per group: its pooled least-squares fit),
    pass@K and distinct answers against held-out avg@n at each evaluation point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), squeeze=False)
    scatter, passes, distinct = axes[0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for g, (label, members) in enumerate(groups_of(runs).items()):
        colour = colours[g % len(colours)]
        xs, ys = [], []
        for run in members:
            x, y = mechanism_points(run)
            xs += x
            ys += y
        if xs:
            slope, corr = fit(xs, ys)
            scatter.scatter(xs, ys, s=12, color=colour, alpha=0.6)
            if slope is not None:
                lo, hi = min(xs), max(xs)
                mx, my = statistics.fmean(xs), statistics.fmean(ys)
                r = f"{corr:.2f}" if corr is not None else "-"
                scatter.plot([lo, hi], [my + slope * (lo - mx), my + slope * (hi - mx)],
                             color=colour, label=f"{label}: slope {slope:.3g}, r {r}")  # fmt: skip
        for ax, key in ((passes, top_pass_key), (distinct, None)):
            for i, run in enumerate(members):
                metric = key(run) if key else "eval/heldout/distinct_answers"
                if metric is None:
                    continue
                acc = dict(zip(*run.series("eval/heldout/avg@*"), strict=True))
                values = dict(zip(*run.series(metric), strict=True))
                steps = [s for s in acc if s in values]
                ax.plot([acc[s] for s in steps], [values[s] for s in steps], "o-", ms=3,
                        color=colour, alpha=0.7, label=label if i == 0 else None)  # fmt: skip
    scatter.axhline(0, color="grey", lw=0.5)
    scatter.axvline(0, color="grey", lw=0.5)
    scatter.set_xlabel("Cov(log pi, A) the update saw (w~ c for CW-GRPO)")
    scatter.set_ylabel("probe entropy change over the step")
    scatter.set_title("dH against Cov, every step of every run")
    passes.set_title("held-out pass@K against avg@n")
    distinct.set_title("distinct answers per problem against avg@n")
    for ax in (passes, distinct):
        ax.set_xlabel("held-out avg@n (pass@1)")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)
