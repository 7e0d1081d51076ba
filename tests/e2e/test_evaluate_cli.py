"""tools/evaluate.py end to end on a tiny model, as users run it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import run_tool

ROOT = Path(__file__).resolve().parents[2]
FIVE = ("aime24", "math500", "amc23", "minerva", "olympiadbench")


def _evaluate_cmd(model_dir, out, *extra) -> list[str]:
    """tools/evaluate.py on a tiny model: 8 new tokens, fp32, `extra` arguments."""
    tool = str(ROOT / "tools" / "evaluate.py")
    fixed = ["--max-tokens", "8", "--max-model-len", "4096", "--dtype", "float32"]
    return [sys.executable, tool, "--model-dir", str(model_dir), "--out", str(out), *fixed, *extra]


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_evaluate_cli_end_to_end_on_a_tiny_model(tmp_path, engine):
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    hf_dir = save_tiny_qwen2(tmp_path / "hf", max_position_embeddings=4096)
    out = tmp_path / "results.json"
    cmd = _evaluate_cmd(
        hf_dir,
        out,
        "--benchmarks",
        ",".join(FIVE),  # read from the package: nothing beside the checkout
        "--limit",
        "2",
        "--n",
        "2",
        "--engine",
        engine,
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "avg@2" in done.stdout and "average" in done.stdout
    assert "evaluating" in done.stderr  # the progress bar
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {*FIVE, "average"}
    for name in FIVE:
        s = result["summary"][name]
        assert s["problems"] + s["skipped_long_prompts"] == 2
        assert set(s) == {"avg@2", "pass@2", "problems", "skipped_long_prompts"}
    assert result["summary"]["aime24"]["problems"] >= 1
    sample = result["samples"][0]
    assert set(sample) == {
        "benchmark",
        "problem_id",
        "answer",
        "completion",
        "tokens",
        "finish_reason",
        "score",
    }
    assert len(result["samples"]) == 2 * sum(result["summary"][b]["problems"] for b in FIVE)
    assert result["settings"]["n"] == 2


def test_evaluate_cli_rejects_unknown_benchmark(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "evaluate.py"),
        "--model-dir",
        str(tmp_path),
        "--benchmarks",
        "gsm8k",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0 and "unknown benchmark 'gsm8k'" in done.stderr


def test_evaluate_takes_a_megatron_checkpoint(tmp_path):
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    hf_dir = save_tiny_qwen2(tmp_path / "hf", max_position_embeddings=4096)
    ckpt = tmp_path / "ckpt"
    # the converter's main (its command is tested in tests/distributed/test_conversion.py)
    code, log = run_tool(
        "convert_hf_to_megatron.py", 1, "--hf-dir", str(hf_dir), "--out", str(ckpt)
    )
    assert code == 0, log
    out = tmp_path / "r.json"
    cmd = _evaluate_cmd(ckpt, out, "--benchmarks", "amc23", "--limit", "3", "--engine", "torch")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "converting the Megatron checkpoint" in done.stdout
    assert json.loads(out.read_text())["summary"]["amc23"]["problems"] == 3
