"""tools/compare_runs.py as users run it, on hand-made runs: the figures, the table, a bad
folder."""

import subprocess
import sys

from tests.unit import test_mechanism
from tests.unit.test_compare_runs import ENTROPY, REPO, REWARDS, write_run


def test_the_tool_writes_the_figure_and_the_table(tmp_path):
    for seed in range(2):
        write_run(tmp_path / f"runs/grpo_s{seed}", "grpo", REWARDS, ENTROPY)
        write_run(tmp_path / f"runs/cw_s{seed}", "cw_grpo", REWARDS[::-1], ENTROPY)
    # runs with a probe set and pass@k: the mechanism's table and figure too
    test_mechanism.write_run(tmp_path / "runs/probed", "cw_grpo", eta=1.0, weighted=True)
    out = tmp_path / "cmp"
    runs = sorted(str(p) for p in (tmp_path / "runs").iterdir())
    done = subprocess.run(
        [sys.executable, "tools/compare_runs.py", *runs, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    table = (out / "compare.md").read_text()
    assert table.startswith("### ") and "| corr(dH, Cov) |" in table
    assert (out / "compare_mechanism.png").stat().st_size > 20_000
    bad = subprocess.run(
        [sys.executable, "tools/compare_runs.py", str(tmp_path), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
