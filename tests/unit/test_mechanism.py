"""The mechanism and diversity statistics of `analysis/mechanism.py` on hand-made runs with
known values: the slope and correlation of the probe entropy's change against the covariance,
the tails of c and w~ c, pass@K at matched accuracy (the command's figure:
tests/e2e/test_compare_runs_cli.py)."""

import json
from pathlib import Path

import pytest

from cwgrpo_megatron.analysis.mechanism import (
    diversity_stats,
    entropy_changes,
    fit,
    mechanism_stats,
    mechanism_table,
)
from cwgrpo_megatron.analysis.run_compare import label_runs, read_run

COV = [0.4, -0.2, 0.1, 0.3, 0.0, -0.1]


def write_run(root: Path, loss: str, *, eta: float, weighted: bool, seed: int = 0) -> Path:
    """Steps 1-6 with covariance COV (w~ c = COV / 2 when `weighted`) and a probe entropy whose
    change over step k is -eta times the covariance the update saw; held-out evaluations at
    steps 0, 3 and 6."""
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(f"algo:\n  policy_loss: {loss}\ntrain:\n  seed: {seed}\n")
    h, lines = 2.0, []
    for step, c in enumerate(COV, start=1):
        line = {"step": step, "probe/entropy": h, "cw/cov_mean": c, "cw/sigma": 1.0,
                "cw/top1pct_cov_share": 0.2, "cw/cov_abs_max": 3.0}  # fmt: skip
        seen = c / 2 if weighted else c
        if weighted:
            line.update({"cw/eff_cov_mean": seen, "cw/eff_top1pct_cov_share": 0.1,
                         "cw/eff_cov_abs_max": 1.0})  # fmt: skip
        h -= eta * seen
        lines.append(line)
    lines[-1]["cw/sigma"] = 0.0  # no signal: left out of the tails
    lines[-1]["cw/cov_abs_max"] = 0.0
    evals = {0: (0.1, 0.3, 3.0), 3: (0.3, 0.7, 2.5), 6: (0.5, 0.8, 2.0)}
    lines.insert(0, {"step": 0})
    for step, (avg, top, distinct) in evals.items():
        lines[step].update({"eval/heldout/avg@4": avg, "eval/heldout/pass@2": avg + 0.1,
                            "eval/heldout/pass@4": top,
                            "eval/heldout/distinct_answers": distinct})  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def test_the_slope_and_correlation_recover_a_planted_mechanism(tmp_path):
    cw = read_run(write_run(tmp_path / "cw", "cw_grpo", eta=0.5, weighted=True))
    assert len(entropy_changes(cw)) == 5  # steps 1-5: step 6 has no probe after it
    stats = mechanism_stats(cw)
    assert stats["slope dH / Cov"] == pytest.approx(-0.5)  # against w~ c, the one applied
    assert stats["corr(dH, Cov)"] == pytest.approx(-1.0)
    assert stats["corr(dH, raw Cov)"] == pytest.approx(-1.0)  # w~ c = c / 2 here
    assert stats["top-1% share of abs c"] == pytest.approx(0.2)
    assert stats["top-1% share of abs w~ c"] == pytest.approx(0.1)
    assert stats["max abs c"] == pytest.approx(3.0)  # step 6 (sigma = 0) is left out
    grpo = mechanism_stats(read_run(write_run(tmp_path / "g", "grpo", eta=2.0, weighted=False)))
    assert grpo["slope dH / Cov"] == pytest.approx(-2.0)
    assert grpo["max abs w~ c"] == grpo["max abs c"] == pytest.approx(3.0)  # w~ = 1


def test_fit_needs_three_points_and_a_varying_covariance():
    assert fit([1.0, 2.0], [1.0, 2.0]) == (None, None)
    assert fit([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) == (None, None)
    slope, corr = fit([0.0, 1.0, 2.0], [1.0, 1.0, 1.0])
    assert slope == 0.0 and corr is None


def test_pass_at_k_and_distinct_answers_are_read_at_matched_accuracy(tmp_path):
    run = read_run(write_run(tmp_path / "cw", "cw_grpo", eta=0.5, weighted=True))
    stats = diversity_stats(run)
    assert stats["pass@4 at avg 0.0-0.2"] == pytest.approx(0.3)  # the largest k logged
    assert stats["pass@4 at avg 0.2-0.4"] == pytest.approx(0.7)
    assert stats["pass@4 at avg 0.4-0.6"] == pytest.approx(0.8)
    assert stats["pass@4 at avg 0.6-0.8"] is None
    assert stats["distinct answers at avg 0.2-0.4"] == pytest.approx(2.5)


def test_the_table_gives_each_group_its_mean_and_seed_spread(tmp_path):
    for seed, eta in enumerate((0.5, 1.5)):
        write_run(tmp_path / f"cw_s{seed}", "cw_grpo", eta=eta, weighted=True, seed=seed)
    write_run(tmp_path / "grpo_s0", "grpo", eta=2.0, weighted=False)
    table = mechanism_table(label_runs(sorted(tmp_path.iterdir())))
    assert "| statistic | cw_grpo (2) | grpo (1) |" in table
    assert "| slope dH / Cov | -1 ± 0.71 | -2 ± 0 |" in table  # sample std of -0.5, -1.5
