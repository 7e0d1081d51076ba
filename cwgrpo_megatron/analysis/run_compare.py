"""Compare training runs from their metrics.jsonl: a figure of the curves and a table per group.

Runs are grouped by a label (default: the run's algo.policy_loss from its config.yaml); a group
of several seeds is drawn as its mean with a min-max band, and tabulated as mean +- std over its
runs (sample std, ddof = 1; 0 for a single run). Per run:

    initial / final held-out accuracy   the first and the last eval/heldout/avg@n
    final reward             reward/mean of the last step
    first step >= 0.9        the first step whose 5-step mean reward (steps t-4..t) is >= 0.9;
                             runs that never get there are counted, not averaged
    entropy range / std      max - min and population std of actor/entropy over the steps
    entropy at matched reward   mean actor/entropy over the steps whose 5-step mean reward lies
                             in [lo, hi) (REWARD_BINS); runs with no such step are left out
    top-1% covariance share  mean cw/top1pct_cov_share over the steps with cw/sigma > 0:
                             the share of sum |c| carried by the 1% of tokens of largest |c|
                             ("extreme tokens"; undefined when every c is 0)
    wall time (s)            sum of timing_s/step and of the step-0 evaluation's timing_s/eval
    rounds per step          mean dynamic/rounds over the steps (dynamic sampling only): the
                             generation rounds a step took to fill its batch with groups that
                             have a reward signal
    steps at the cap         how many steps ended their rounds short of a full batch

The last one separates "a narrower entropy band" from "learning more slowly": two algorithms
compared at the same reward, not at the same step.

Paired groups (`paired_table`, `plot_pairs`): two settings run at the same seeds (matched by
train.seed in each run's config.yaml), for each metric of PAIRED:

    paired gap      mean over seeds and steps of |a_t - b_t| at the same seed and step
    seed spread     mean over steps of the std over seeds (ddof = 1) within a group, of a and
                    of b
    gap / spread    below 1: the two settings differ by less than one seed from another
"""

from __future__ import annotations

import fnmatch
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cwgrpo_megatron.common.files import save_figure

WINDOW = 5
TARGET_REWARD = 0.9
REWARD_BINS = ((0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9))
# Steps where every advantage is its pool's mean (every group's rewards equal) have c = 0 on
# every token and sigma = 0: the share is undefined there, and the CW weights are all 1 but
# weigh nothing (A = 0), so such steps are left out of these curves and statistics.
SIGNAL_ONLY = {
    "cw/top1pct_cov_share",
    "cw/eff_top1pct_cov_share",
    "cw/cov_abs_max",
    "cw/eff_cov_abs_max",
    "cw/w_min",
    "cw/frac_w_below_half",
}
PANELS = (
    ("reward", ("reward/mean",)),
    ("held-out accuracy", ("eval/heldout/avg@*",)),
    ("held-out pass@16, pass@4", ("eval/heldout/pass@16", "eval/heldout/pass@4")),
    ("entropy (nats)", ("actor/entropy",)),
    ("probe-set entropy (nats)", ("probe/entropy",)),
    ("response length (tokens)", ("response_length/mean",)),
    ("CW weights", ("cw/w_min", "cw/frac_w_below_half")),
    ("grad norm", ("actor/grad_norm",)),
    ("top-1% tokens' share of sum |c|", ("cw/top1pct_cov_share",)),
    ("sigma of c (kernel bandwidth)", ("cw/sigma",)),
    ("generation rounds per step", ("dynamic/rounds",)),
)
"""The figure's panels; one whose metrics no run has (rounds without dynamic sampling) is left
out."""
PAIRED = (
    "cw/sigma",
    "cw/cov_mean",
    "cw/top1pct_cov_share",
    "cw/w_min",
    "cw/frac_w_below_half",
    "actor/entropy",
    "reward/mean",
    "eval/heldout/avg@*",
)
"""The metrics `paired_table` and `plot_pairs` compare."""


@dataclass
class Run:
    path: Path
    label: str
    lines: list[dict] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` (a glob, e.g. eval/heldout/avg@*), finite values only;
        for the SIGNAL_ONLY keys, only steps with a learning signal (cw/sigma > 0)."""
        steps, values = [], []
        for line in self.lines:
            if key in SIGNAL_ONLY and not line.get("cw/sigma", 0.0) > 0:
                continue
            for name, value in line.items():
                if name != "step" and fnmatch.fnmatch(name, key) and _finite(value):
                    steps.append(int(line["step"]))
                    values.append(float(value))
                    break
        return steps, values


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def read_run(path: str | Path, label: str | None = None) -> Run:
    """A run folder (or its metrics.jsonl); ValueError naming what is missing or malformed."""
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    root = metrics.parent
    if not metrics.is_file():
        raise ValueError(f"{path}: no metrics.jsonl (is it a run folder of cwgrpo_megatron.train?)")
    lines = []
    for number, text in enumerate(metrics.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{metrics}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(line, dict) or "step" not in line:
            raise ValueError(f"{metrics}:{number}: a metrics line needs a step")
        lines.append(line)
    if label is None:
        label = _policy_loss(root) or root.name
    return Run(path=root, label=label, lines=lines)


def _setting(root: Path, section: str, key: str):
    """`section.key` of the run's config.yaml, or None."""
    config = root / "config.yaml"
    if not config.is_file():
        return None
    data = yaml.safe_load(config.read_text()) or {}
    return (data.get(section) or {}).get(key)


def _policy_loss(root: Path) -> str | None:
    return _setting(root, "algo", "policy_loss")


def label_runs(paths: Sequence[str | Path], labels: Sequence[str] = ()) -> list[Run]:
    """Runs labelled by `NAME=GLOB` rules (first match wins; GLOB matches the folder path),
    else by policy loss."""
    rules = []
    for rule in labels:
        name, sep, pattern = rule.partition("=")
        if not sep or not name or not pattern:
            raise ValueError(f"--label {rule!r}: write NAME=GLOB, e.g. cw_grpo='runs/cw_*'")
        rules.append((name, pattern))
    runs = []
    for path in paths:
        label = next((n for n, g in rules if fnmatch.fnmatch(str(path), g)), None)
        runs.append(read_run(path, label))
    return runs


def _seed(run: Run) -> int | None:
    return _setting(run.path, "train", "seed")


def pairs_of(runs: Sequence[Run], a: str, b: str) -> list[tuple[Run, Run]]:
    """(run of a, run of b) at each seed both groups ran; ValueError when a group is missing,
    or a seed is not known or twice in a group."""
    groups = groups_of(runs)
    by_seed = {}
    for label in (a, b):
        if label not in groups:
            raise ValueError(f"--pair {a},{b}: no runs labelled {label!r} (have {sorted(groups)})")
        seeds = {}
        for run in groups[label]:
            seed = _seed(run)
            if seed is None or seed in seeds:
                raise ValueError(
                    f"{run.path}: its train.seed is {'unknown' if seed is None else 'repeated'} "
                    f"in group {label!r}; pairs need one run per seed and setting"
                )
            seeds[seed] = run
        by_seed[label] = seeds
    common = sorted(set(by_seed[a]) & set(by_seed[b]))
    if not common:
        raise ValueError(f"--pair {a},{b}: the two groups share no seed")
    return [(by_seed[a][s], by_seed[b][s]) for s in common]


def paired_gaps(pairs, key: str) -> dict[int, tuple[float, float, float]]:
    """step -> (mean |a - b| over the pairs, std over seeds of a, of b), at the steps every run
    of the pairs logged `key`."""
    series = [(dict(zip(*x.series(key), strict=True)), dict(zip(*y.series(key), strict=True)))
              for x, y in pairs]  # fmt: skip
    steps = set.intersection(*(set(x) & set(y) for x, y in series)) if series else set()
    out = {}
    for t in sorted(steps):
        a, b = [x[t] for x, _ in series], [y[t] for _, y in series]
        spread_a = statistics.stdev(a) if len(a) > 1 else 0.0
        spread_b = statistics.stdev(b) if len(b) > 1 else 0.0
        out[t] = (statistics.fmean(abs(u - v) for u, v in zip(a, b, strict=True)), spread_a,
                  spread_b)  # fmt: skip
    return out


def paired_table(runs: Sequence[Run], a: str, b: str) -> str:
    """Markdown: per PAIRED metric, the paired gap against the seed spread (module doc)."""
    pairs = pairs_of(runs, a, b)
    lines = [
        f"### {a} against {b}: the same seeds ({', '.join(str(_seed(x)) for x, _ in pairs)})",
        "",
        f"| metric | steps | paired gap, {a} to {b} | seed spread {a} | seed spread {b} "
        "| gap / spread |",
        "|---|---|---|---|---|---|",
    ]
    for key in PAIRED:
        gaps = paired_gaps(pairs, key)
        if not gaps:
            continue
        gap = statistics.fmean(g for g, _, _ in gaps.values())
        spread_a = statistics.fmean(x for _, x, _ in gaps.values())
        spread_b = statistics.fmean(y for _, _, y in gaps.values())
        spread = (spread_a + spread_b) / 2
        ratio = f"{gap / spread:.2f}" if spread > 0 else "-"
        lines.append(
            f"| {key} | {len(gaps)} | {gap:.4g} | {spread_a:.4g} | {spread_b:.4g} | {ratio} |"
        )
    lines.append("")
    return "\n".join(lines)


def groups_of(runs: Sequence[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.label, []).append(run)
    return out


# ---- per-run statistics ----------------------------------------------------------------------


def rolling_reward(run: Run) -> dict[int, float]:
    """step -> mean reward/mean over that step and the WINDOW - 1 before it (full windows)."""
    steps, values = run.series("reward/mean")
    out = {}
    for i in range(WINDOW - 1, len(values)):
        out[steps[i]] = sum(values[i - WINDOW + 1 : i + 1]) / WINDOW
    return out


def run_stats(run: Run) -> dict[str, float | None]:
    rewards = run.series("reward/mean")[1]
    held = run.series("eval/heldout/avg@*")[1]
    entropy_steps, entropy = run.series("actor/entropy")
    rolling = rolling_reward(run)
    reached = [s for s, r in rolling.items() if r >= TARGET_REWARD]
    extreme = run.series("cw/top1pct_cov_share")[1]
    seconds = run.series("timing_s/step")[1] + [
        line["timing_s/eval"]
        for line in run.lines
        if line.get("step") == 0 and _finite(line.get("timing_s/eval"))
    ]
    stats: dict[str, float | None] = {
        "initial held-out accuracy": held[0] if len(held) > 1 else None,
        "final held-out accuracy": held[-1] if held else None,
        "final reward": rewards[-1] if rewards else None,
        "first step >= 0.9": min(reached) if reached else None,
        "entropy range": max(entropy) - min(entropy) if entropy else None,
        "entropy std": statistics.pstdev(entropy) if entropy else None,
    }
    by_step = dict(zip(entropy_steps, entropy, strict=True))
    for lo, hi in REWARD_BINS:
        inside = [by_step[s] for s, r in rolling.items() if lo <= r < hi and s in by_step]
        stats[f"entropy at reward {lo:.1f}-{hi:.1f}"] = (
            sum(inside) / len(inside) if inside else None
        )
    stats["top-1% covariance share"] = statistics.fmean(extreme) if extreme else None
    stats["wall time (s)"] = sum(seconds) if seconds else None
    rounds = run.series("dynamic/rounds")[1]
    stats["rounds per step"] = statistics.fmean(rounds) if rounds else None
    stats["steps at the cap"] = sum(run.series("dynamic/cap_reached")[1]) if rounds else None
    return stats


def group_table(runs: Sequence[Run]) -> list[tuple[str, str]]:
    """(statistic, "mean +- std (n runs)") rows for one group."""
    per_run = [run_stats(r) for r in runs]
    rows = []
    for name in per_run[0]:
        values = [s[name] for s in per_run if s[name] is not None]
        if not values:
            cell = "-"
        else:
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            cell = f"{statistics.fmean(values):.3f} ± {std:.3f}"
            if len(values) < len(runs):
                cell += f" ({len(values)} of {len(runs)} runs)"
        rows.append((name, cell))
    return rows


def markdown(runs: Sequence[Run]) -> str:
    lines = []
    for label, members in groups_of(runs).items():
        lines.append(f"### {label} ({len(members)} run{'s' if len(members) > 1 else ''})")
        lines.append("")
        lines.append("| statistic | mean ± std over runs |")
        lines.append("|---|---|")
        lines += [f"| {name} | {cell} |" for name, cell in group_table(members)]
        lines.append("")
        lines.append("Runs: " + ", ".join(f"`{r.path}`" for r in members))
        lines.append("")
    return "\n".join(lines)


# ---- the figure ------------------------------------------------------------------------------


def _band(runs: Sequence[Run], key: str):
    """Steps present in every run, and the mean / min / max over runs at each."""
    series = [dict(zip(*r.series(key), strict=True)) for r in runs]
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    values = [[s[t] for s in series] for t in common]
    return (
        common,
        [statistics.fmean(v) for v in values],
        [min(v) for v in values],
        [max(v) for v in values],
    )


def plot(runs: Sequence[Run], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, keys) for t, keys in PANELS if any(r.series(keys[0])[0] for r in runs)]
    columns = -(-len(panels) // 2)
    fig, axes = plt.subplots(2, columns, figsize=(4.75 * columns, 8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for g, (label, members) in enumerate(groups_of(runs).items()):
            for k, key in enumerate(keys):
                steps, mean, low, high = _band(members, key)
                if not steps:
                    continue
                style = "-" if k == 0 else "--"
                name = label if len(keys) == 1 else f"{label} {key.split('/')[-1]}"
                colour = colours[g % len(colours)]
                marker = "o" if len(steps) < 4 else None
                ax.plot(steps, mean, style, color=colour, label=name, marker=marker)
                if len(members) > 1:
                    ax.fill_between(steps, low, high, color=colour, alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("mean over seeds, band: min-max")
    fig.tight_layout()
    return save_figure(fig, out)


def plot_pairs(runs: Sequence[Run], a: str, b: str, out: Path) -> Path:
    """Per PAIRED metric, by step: the paired gap |a - b| and the seed spread of each group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = pairs_of(runs, a, b)
    by_key = {key: paired_gaps(pairs, key) for key in PAIRED}
    keys = [key for key in PAIRED if by_key[key]]
    columns = -(-len(keys) // 2)
    fig, axes = plt.subplots(2, columns, figsize=(4.75 * columns, 8), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys, strict=False):
        gaps = by_key[key]
        steps = list(gaps)
        marker = "o" if len(steps) < 4 else None
        ax.plot(steps, [g for g, _, _ in gaps.values()], "-", marker=marker,
                label=f"|{a} - {b}|, same seed")  # fmt: skip
        ax.plot(steps, [x for _, x, _ in gaps.values()], "--", marker=marker,
                label=f"std over seeds, {a}")  # fmt: skip
        ax.plot(steps, [y for _, _, y in gaps.values()], ":", marker=marker,
                label=f"std over seeds, {b}")  # fmt: skip
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{a} vs {b}: the gap at the same seed against the spread over seeds")
    fig.tight_layout()
    return save_figure(fig, out)
