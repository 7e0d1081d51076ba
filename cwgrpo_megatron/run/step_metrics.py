"""The metrics line of a training step: names, and the values that come from the rollouts.

    reward/mean, reward/std           weighted reward over all P x G completions (population std)
    reward/<name>                     each reward function's own mean score
    reward/<name>/<key>               a reward's other named values (a dict per completion),
                                      and reward/<name>/errors: the share it failed to score
                                      (reward.on_error=zero)
    accuracy/mean                     share of completions math-verify finds correct
    response_length/mean, /max        completion tokens
    response_length/clip_ratio        share of completions cut at rollout.max_tokens
    response/repetition_4gram         mean share of repeated word 4-grams
    groups/frac_zero_std              share of prompt groups whose rewards are all equal (A = 0)
    probe/entropy                     mean token entropy on the fixed probe set, before the
                                      step's update (run.probe_groups)
    actor/*, cw/*, rollout/gap_*      the loss's metrics (`algo.metrics`, reduced over the global
                                      batch), averaged over the step's PPO mini-batches
    actor/padded_tokens               token positions the training passes ran over (rows x
    actor/micro_batches               micro-batch length) and micro-batches, over DP ranks
                                      and mini-batches (train.max_tokens_per_micro_batch)
    sync/gap, sync/tol                engine-vs-trainer log-prob gap (worst token) after the
    sync/gap_mean, sync/tol_mean      sync and the check's tolerance, and the same for the
                                      mean over tokens, on steps where run.verify_sync checks
    timing_s/<phase>, perf/tokens_per_s

cw/sigma is the population std of the covariance c over all counted tokens (the kernel's
bandwidth in the global scope), cw/ess the effective sample size of the weights as a share of
the tokens, ESS / N = 1 / E[w~^2], and cw/top1pct_cov_share the share of sum |c| carried by
the 1% of tokens of largest |c| (the paper's "extreme tokens"; from a histogram of c with bins
a factor 1.33 wide, `algo.metrics.top_share`). The histogram of c itself goes to TensorBoard
as cw/cov (`cov_histogram`). cw/eff_* (CW-GRPO) are the same statistics of w~ c, the
covariance with the advantages as the update weights them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from cwgrpo_megatron.algo.metrics import PARTS
from cwgrpo_megatron.reward.repetition import repeated_ngram_fraction

PHASES = (
    "rollout",
    "rollout_wait",
    "sleep",
    "reward",
    "probe",
    "old_logp",
    "train",
    "wake",
    "sync",
    "eval",
    "checkpoint",
    "step",
)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rollout_metrics(groups) -> dict[str, float]:
    """Metrics of the step's scored groups (`reward.scoring.ScoredGroup`), on the host."""
    rewards = [r for g in groups for r in g.rewards]
    mean = _mean(rewards)
    completions = [c for g in groups for c in g.completions]
    lengths = [len(c.token_ids) for c in completions]
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(_mean([(r - mean) ** 2 for r in rewards])),
        "accuracy/mean": _mean([x for g in groups for x in g.correct]),
        "response_length/mean": _mean(lengths),
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": _mean([c.finish_reason == "length" for c in completions]),
        "response/repetition_4gram": _mean(
            [repeated_ngram_fraction(t, 4) for g in groups for t in g.texts]
        ),
        "groups/frac_zero_std": _mean([len(set(g.rewards)) == 1 for g in groups]),
    }
    for name in groups[0].parts if groups else ():
        out[f"reward/{name}"] = _mean([x for g in groups for x in g.parts[name]])
    for key in sorted({k for g in groups for k in g.details}):
        # a key some groups lack (errors counted with reward.on_error=zero) is 0 there
        values = [x for g in groups for x in g.details.get(key, [0.0] * len(g.rewards))]
        out[f"reward/{key}"] = _mean(values)
    return out


def actor_metrics(results) -> dict[str, float]:
    """The step's optimizer updates (`train_step.StepResult`s), averaged over mini-batches."""
    out = {
        "actor/loss": _mean([r.loss for r in results]),
        "actor/grad_norm": _mean([r.grad_norm for r in results]),
        "actor/lr": results[-1].lr,
        "actor/skipped_updates": float(sum(r.skipped for r in results)),
        "actor/padded_tokens": float(sum(r.padded_tokens for r in results)),
        "actor/micro_batches": float(sum(r.micro_batches for r in results)),
    }
    for name in results[0].metrics:
        if name not in PARTS:
            out[name] = _mean([r.metrics[name] for r in results])
    return out


class Histogram(NamedTuple):
    """A histogram in the form of TensorBoard's `add_histogram_raw`."""

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    """The right edge of each bin."""
    bucket_counts: list[float]


def cov_histogram(results) -> Histogram | None:
    """The covariance c of every token the step trained on: its mini-batches' histograms
    (`algo.metrics.covariance_histogram`) summed; None when there are none. The sum and the sum
    of squares are exact, from each mini-batch's cw/cov_mean and cw/cov_sq_mean."""
    from cwgrpo_megatron.algo.metrics import COV_BINS, cov_bin_edges

    if not results or "cw/cov_hist_count" not in results[0].histograms:
        return None
    per_batch = [r.histograms["cw/cov_hist_count"] for r in results]
    counts = [sum(h[i] for h in per_batch) for i in range(COV_BINS)]
    tokens = [sum(h) for h in per_batch]
    if sum(tokens) == 0:
        return None
    edges = cov_bin_edges().tolist()
    used = [i for i, k in enumerate(counts) if k > 0]
    return Histogram(
        min=edges[used[0]],
        max=edges[used[-1] + 1],
        num=sum(tokens),
        sum=sum(r.metrics["cw/cov_mean"] * n for r, n in zip(results, tokens, strict=True)),
        sum_squares=sum(
            r.metrics["cw/cov_sq_mean"] * n for r, n in zip(results, tokens, strict=True)
        ),
        bucket_limits=edges[1:],
        bucket_counts=counts,
    )


def step_tokens(groups) -> int:
    """Prompt and completion tokens of every sequence of the step (no padding)."""
    return sum(len(g.prompt_ids) * len(g.completions) for g in groups) + sum(
        len(c.token_ids) for g in groups for c in g.completions
    )


def timing_metrics(seconds: dict[str, float], *, tokens: int) -> dict[str, float]:
    """timing_s/<phase> for every phase (0 when it did not run) and perf/tokens_per_s: prompt
    and completion tokens of the step's batch per second of the whole step."""
    out = {f"timing_s/{phase}": float(seconds.get(phase, 0.0)) for phase in PHASES}
    out["perf/tokens_per_s"] = tokens / max(out["timing_s/step"], 1e-9)
    return out
