"""The benchmark scripts run end to end (tiny shapes); their figures are not asserted here."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script", ["bench_logprob.py", "bench_cw_overhead.py"])
def test_benchmark_runs_quick(script):
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "target" in done.stdout
