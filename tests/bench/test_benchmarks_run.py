"""The benchmark scripts run end to end (tiny shapes); their figures are not asserted here."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


SMOKE = {
    "bench_logprob.py": ["--quick", "--repeats", "1"],
    "bench_cw_overhead.py": ["--quick", "--repeats", "1"],
    "bench_convert.py": ["--quick"],
    "bench_train_step.py": ["--steps", "1"],
    "bench_reward.py": ["--pairs", "40", "--warm", "4"],
    "bench_rollout.py": ["--quick", "--repeats", "1"],
    "bench_weight_sync.py": ["--quick", "--repeats", "1"],
    "bench_e2e.py": [
        "--quick",
        "--prompts",
        "2",
        "--group",
        "2",
        "--tokens",
        "8",
        "--arms",
        "cw_grpo+rollout",
    ],
    "bench_vllm_compile.py": ["--quick"],
    "bench_microbatch.py": ["--quick"],
    "bench_rollout_scale.py": ["--quick"],
    "bench_async.py": ["--quick"],
    "bench_stats_noise.py": ["--quick"],
}


def test_every_benchmark_has_a_smoke_run():
    assert sorted(SMOKE) == sorted(p.name for p in BENCH.glob("bench_*.py"))


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_small(script):
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *SMOKE[script]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target" in done.stdout
