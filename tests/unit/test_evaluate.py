"""Benchmark evaluation: the pass@k estimator, and tools/evaluate.py end to end on a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cwgrpo_megatron.data.prompts import Problem
from cwgrpo_megatron.eval.metrics import pass_at_k
from cwgrpo_megatron.eval.runner import evaluate, format_table
from cwgrpo_megatron.rollout import SamplingConfig
from cwgrpo_megatron.rollout.base import Completion, RolloutGroup

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"


def _evaluate_cmd(model_dir, out, *extra) -> list[str]:
    """tools/evaluate.py on a tiny model: 8 new tokens, fp32, `extra` arguments."""
    tool = str(ROOT / "tools" / "evaluate.py")
    fixed = ["--max-tokens", "8", "--max-model-len", "4096", "--dtype", "float32"]
    return [sys.executable, tool, "--model-dir", str(model_dir), "--out", str(out), *fixed, *extra]


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # avg@n
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


class ScriptedEngine:
    """Returns fixed completion texts (a test double for the scoring path only)."""

    max_model_len = 4096
    version = 0

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, n, sampling):
        groups = []
        for i, prompt in enumerate(prompts):
            ids = [self.tokenizer(t)["input_ids"] for t in self.texts[i][:n]]
            completions = [Completion(x, [0.0] * len(x), "stop") for x in ids]
            groups.append(RolloutGroup(list(prompt), completions, 0))
        return groups


def test_avg_and_pass_at_n_from_scored_completions():
    from cwgrpo_megatron.data.tokenizers import qwen25_tokenizer

    tok = qwen25_tokenizer()
    problems = [
        Problem(id="a", problem="1+1?", answer="2"),
        Problem(id="b", problem="2+2?", answer="4"),
    ]
    texts = [
        ["so \\boxed{2}", "\\boxed{3}", "\\boxed{2}", "no answer"],  # 2 of 4
        ["\\boxed{5}", "\\boxed{5}", "\\boxed{5}", "\\boxed{5}"],  # 0 of 4
    ]
    result = evaluate(
        ScriptedEngine(tok, texts),
        tok,
        {"toy": problems},
        n=4,
        sampling=SamplingConfig(max_tokens=8, seed=0),
        progress=False,
    )
    toy = result["summary"]["toy"]
    assert toy["avg@4"] == pytest.approx((0.5 + 0.0) / 2) and toy["pass@4"] == pytest.approx(0.5)
    assert [s["score"] for s in result["samples"]] == [1, 0, 1, 0, 0, 0, 0, 0]
    assert "toy" in format_table(result["summary"], 4)


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is not beside this checkout")
@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_evaluate_cli_end_to_end_on_a_tiny_model(tmp_path, engine):
    from cwgrpo_megatron.rollout.tiny import save_tiny_qwen2

    hf_dir = save_tiny_qwen2(tmp_path / "hf", max_position_embeddings=4096)
    out = tmp_path / "results.json"
    cmd = _evaluate_cmd(
        hf_dir,
        out,
        "--benchmarks",
        "aime24,math500",
        "--limit",
        "5",
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
    assert set(result["summary"]) == {"aime24", "math500", "average"}
    for name in ("aime24", "math500"):
        s = result["summary"][name]
        assert s["problems"] + s["skipped_long_prompts"] == 5
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
    assert len(result["samples"]) == 2 * sum(
        result["summary"][b]["problems"] for b in ("aime24", "math500")
    )
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


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is not beside this checkout")
def test_evaluate_takes_a_megatron_checkpoint(tmp_path):
    from cwgrpo_megatron.rollout.tiny import save_tiny_qwen2

    hf_dir = save_tiny_qwen2(tmp_path / "hf", max_position_embeddings=4096)
    ckpt = tmp_path / "ckpt"
    convert = [sys.executable, str(ROOT / "tools" / "convert_hf_to_megatron.py")]
    subprocess.run(
        [*convert, "--hf-dir", str(hf_dir), "--out", str(ckpt)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    out = tmp_path / "r.json"
    cmd = _evaluate_cmd(ckpt, out, "--benchmarks", "amc23", "--limit", "3", "--engine", "torch")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "converting the Megatron checkpoint" in done.stdout
    assert json.loads(out.read_text())["summary"]["amc23"]["problems"] == 3
