"""tools/gpu_check.py without a GPU: the plan and the wheel folder (`--dry-run`), and a run
that skips every check and says why. Its checks themselves need a GPU."""

import runpy
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


def _main():
    return runpy.run_path(str(TOOL), run_name="gpu_check")["main"]


def test_dry_run_lists_every_check_and_the_wheels_a_folder_lacks(tmp_path, capsys):
    main = _main()
    assert main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    names = runpy.run_path(str(TOOL), run_name="gpu_check")["CHECKS"]
    assert {"sync_vllm_ipc", "sync_vllm_nccl", "sync_vllm", "vllm", "resume", "planner"} <= set(
        names
    )
    for name in names:
        assert f"check {name} " in out
    assert main(["--dry-run", "--wheels", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "wheel megatron-core" in captured.out and "MISSING" in captured.out
    assert "lacks megatron-core" in captured.err and "--prepare-wheels" in captured.err


def test_without_a_gpu_every_check_skips_and_the_report_is_written(tmp_path, capsys):
    out = tmp_path / "gpu_check.txt"
    assert _main()(["--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("SKIP cuda") and "no CUDA device" in lines[0]
    count = len(runpy.run_path(str(TOOL), run_name="gpu_check")["CHECKS"])
    assert sum(line.startswith("SKIP ") for line in lines) == count  # a line a check
    assert f"0 PASS, 0 FAIL, {count} SKIP" in capsys.readouterr().out
