"""tools/compare_runs.py as users run it, on hand-made runs: the figure, the table, a bad folder."""

import subprocess
import sys

from tests.unit.test_compare_runs import ENTROPY, REPO, REWARDS, write_run


def test_the_tool_writes_the_figure_and_the_table(tmp_path):
    for seed in range(2):
        write_run(tmp_path / f"runs/grpo_s{seed}", "grpo", REWARDS, ENTROPY)
        write_run(tmp_path / f"runs/cw_s{seed}", "cw_grpo", REWARDS[::-1], ENTROPY)
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
    assert (out / "compare.md").read_text().startswith("### ")
    bad = subprocess.run(
        [sys.executable, "tools/compare_runs.py", str(tmp_path), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
