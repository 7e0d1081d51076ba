"""tools/compare_runs.py on hand-made runs with known values: exact statistics, the figure."""

import json
import statistics
from pathlib import Path

import pytest

from cwgrpo_megatron.analysis.run_compare import (
    label_runs,
    markdown,
    paired_gaps,
    paired_table,
    pairs_of,
    plot_pairs,
    read_run,
    run_stats,
)

REPO = Path(__file__).resolve().parents[2]


def write_run(root: Path, loss: str, rewards, entropies, heldout=(0.25, 0.75), seed=None) -> Path:
    root.mkdir(parents=True)
    train = "" if seed is None else f"train:\n  seed: {seed}\n"
    (root / "config.yaml").write_text(f"algo:\n  policy_loss: {loss}\n{train}")
    lines = [{"step": 0, "eval/heldout/avg@1": heldout[0], "timing_s/eval": 4.5}]
    for step, (r, e) in enumerate(zip(rewards, entropies, strict=True), start=1):
        lines.append(
            {
                "step": step,
                "reward/mean": r,
                "actor/entropy": e,
                "response_length/mean": 10.0 + step,
                "cw/w_min": 0.5,
                "cw/frac_w_below_half": 0.1,
                "actor/grad_norm": "nan" if step == 2 else 1.0,
                "cw/top1pct_cov_share": 0.05 * step,
                "cw/sigma": 0.0 if step == 3 else 1.0,  # step 3: no learning signal
                "timing_s/step": 10.0,
            }
        )
    lines[-1]["eval/heldout/avg@1"] = heldout[1]
    (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


REWARDS = [0.1, 0.3, 0.5, 0.7, 0.9, 0.9, 1.0, 1.0]  # 5-step means: 0.5, 0.66, 0.8, 0.9
ENTROPY = [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6]


def test_run_statistics_are_exact(tmp_path):
    run = read_run(write_run(tmp_path / "a", "cw_grpo", REWARDS, ENTROPY))
    stats = run_stats(run)
    assert stats["final reward"] == 1.0
    assert stats["final held-out accuracy"] == 0.75
    assert stats["first step >= 0.9"] == 8  # the 5-step mean of steps 4-8 is 0.9
    assert stats["entropy range"] == pytest.approx(1.4)
    assert stats["entropy std"] == pytest.approx(0.458257569, rel=1e-8)  # pstdev of ENTROPY
    assert stats["entropy at reward 0.5-0.6"] == pytest.approx(1.2)  # step 5 only
    assert stats["entropy at reward 0.6-0.7"] == pytest.approx(1.0)  # step 6 (0.66)
    assert stats["entropy at reward 0.8-0.9"] == pytest.approx(0.8)  # step 7 (0.8)
    assert stats["entropy at reward 0.7-0.8"] is None
    assert stats["initial held-out accuracy"] == 0.25
    # mean of 0.05, 0.10, 0.20, ..., 0.40: step 3 (sigma = 0) has no share
    assert stats["top-1% covariance share"] == pytest.approx((0.05 * 36 - 0.15) / 7)
    assert stats["wall time (s)"] == 84.5  # 8 steps of 10 s and the step-0 evaluation


def test_groups_give_mean_and_std_over_seeds(tmp_path):
    write_run(tmp_path / "grpo_s0", "grpo", REWARDS, ENTROPY, heldout=(0.2, 0.6))
    write_run(tmp_path / "grpo_s1", "grpo", REWARDS, ENTROPY, heldout=(0.2, 0.8))
    write_run(tmp_path / "cw_s0", "cw_grpo", [0.1] * 8, ENTROPY)
    runs = label_runs(sorted(tmp_path.iterdir()))
    table = markdown(runs)
    assert "### grpo (2 runs)" in table and "### cw_grpo (1 run)" in table
    assert "| final held-out accuracy | 0.700 ± 0.141 |" in table  # sample std of 0.6, 0.8
    assert "| first step >= 0.9 | 8.000 ± 0.000 |" in table
    assert "| first step >= 0.9 | - |" in table  # cw_grpo never reaches it
    relabelled = label_runs(sorted(tmp_path.iterdir()), ["mine=*cw_*", "theirs=*grpo_*"])
    assert {r.label for r in relabelled} == {"mine", "theirs"}
    with pytest.raises(ValueError, match="NAME=GLOB"):
        label_runs([tmp_path / "cw_s0"], ["nonsense"])


def test_paired_settings_give_the_gap_at_each_seed_against_the_seed_spread(tmp_path):
    root = tmp_path / "runs"
    # a: entropies E + seed; b: the same + 0.1 at seed 0 and + 0.3 at seed 1
    for seed, shift in ((0, 0.1), (1, 0.3)):
        shifted = [e + seed for e in ENTROPY]
        write_run(root / f"a_seed{seed}", "cw_grpo", REWARDS, shifted, seed=seed)
        b_entropy = [e + shift for e in shifted]
        write_run(root / f"b_seed{seed}", "cw_grpo", REWARDS, b_entropy, seed=seed)
    runs = label_runs(sorted(root.iterdir()), ["a=*/a_*", "b=*/b_*"])
    pairs = pairs_of(runs, "a", "b")
    assert [(x.path.name, y.path.name) for x, y in pairs] == [
        ("a_seed0", "b_seed0"),
        ("a_seed1", "b_seed1"),
    ]
    gaps = paired_gaps(pairs, "actor/entropy")
    assert list(gaps) == list(range(1, 9))
    spread_a = statistics.stdev([0.0, 1.0])  # the seeds differ by 1 at every step
    spread_b = statistics.stdev([0.1, 1.3])
    for gap, a, b in gaps.values():
        assert gap == pytest.approx(0.2) and a == pytest.approx(spread_a)
        assert b == pytest.approx(spread_b)
    table = paired_table(runs, "a", "b")
    ratio = 0.2 / ((spread_a + spread_b) / 2)
    assert f"| actor/entropy | 8 | 0.2 | {spread_a:.4g} | {spread_b:.4g} | {ratio:.2f} |" in table
    assert "| reward/mean | 8 | 0 | 0 | 0 | - |" in table  # the same rewards: no spread
    png = plot_pairs(runs, "a", "b", tmp_path / "pairs.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no runs labelled 'c'"):
        pairs_of(runs, "a", "c")
    write_run(root / "a_again", "cw_grpo", REWARDS, ENTROPY, seed=0)
    again = label_runs(sorted(root.iterdir()), ["a=*/a_*", "b=*/b_*"])
    with pytest.raises(ValueError, match="its train.seed is repeated in group 'a'"):
        pairs_of(again, "a", "b")
