"""tools/evaluate.py end to end on tiny models, as users run it: the commands of
docs/evaluation.md on a model whose 1536 positions are fewer than their defaults (each runs
with a clamped length or stops before the engine starts, naming the flag), a training run's
folder (its engine, lengths and prompt format), a Megatron checkpoint, a bad name."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import run_tool
from tests.e2e.test_train import vllm_run  # noqa: F401  (the run folder the docs' command reads)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "evaluate.py"
FIVE = ("aime24", "math500", "amc23", "minerva", "olympiadbench")
POSITIONS = 1536
"""Fewer than the defaults' 1024 + 4096 tokens: --max-tokens is clamped to 512."""


def documented_commands() -> list[list[str]]:
    """The tools/evaluate.py commands of docs/evaluation.md, as argument lists."""
    text = (ROOT / "docs" / "evaluation.md").read_text()
    blocks = "\n".join(re.findall(r"(?ms)^```bash\n(.*?)^```", text))
    lines = re.sub(r"\\\n\s*", " ", blocks).splitlines()
    return [shlex.split(line) for line in lines if line.startswith("python tools/evaluate.py")]


COMMANDS = documented_commands()


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    root = tmp_path_factory.mktemp("short")
    return save_tiny_qwen2(root / "hf", max_position_embeddings=POSITIONS)


def run_documented(command: list[str], cwd: Path, **names) -> subprocess.CompletedProcess:
    """`command` with python, the tool and the placeholders (MODEL=..., RUN_DIR=...) filled
    in, on the first 2 problems of each benchmark, in `cwd`."""
    fill = {"python": sys.executable, "tools/evaluate.py": str(TOOL), **names}
    argv = [str(fill.get(arg, arg)) for arg in command] + ["--limit", "2"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd, check=False)


def test_the_docs_show_each_kind_of_command():
    assert len(COMMANDS) == 3, COMMANDS
    plain, run, large = COMMANDS
    assert "MODEL" in plain and "--max-tokens" not in plain
    assert "RUN_DIR" in run and "--tp" in large and "--max-tokens" in large


@pytest.mark.parametrize("engine", ["vllm", "torch"])
def test_the_documented_command_runs_with_a_clamped_length(short_model, tmp_path, engine):
    done = run_documented([*COMMANDS[0], "--engine", engine], tmp_path, MODEL=short_model)
    assert done.returncode == 0, done.stderr[-3000:]
    clamped = "--max-tokens 512: what the model's 1536 tokens leave after --max-prompt-tokens 1024"
    assert clamped in done.stdout
    assert "avg@4" in done.stdout and "average" in done.stdout
    assert "evaluating" in done.stderr  # the progress bar
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["summary"]) == {*FIVE, "average"}
    for name in FIVE:
        s = result["summary"][name]
        assert s["problems"] + s["skipped_long_prompts"] == 2
        keys = {"avg@4", "pass@2", "pass@4", "distinct_answers"}
        assert set(s) == keys | {"problems", "skipped_long_prompts"}
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
        "final_answer",
    }
    assert len(result["samples"]) == 4 * sum(result["summary"][b]["problems"] for b in FIVE)
    assert max(x["tokens"] for x in result["samples"]) <= 512
    settings = result["settings"]
    assert (settings["n"], settings["max_tokens"], settings["max_model_len"]) == (4, 512, 1536)
    assert settings["engine"] == engine and settings["run_config"] is None


def test_the_documented_command_on_a_run_takes_its_settings(vllm_run, tmp_path):  # noqa: F811
    done = run_documented(COMMANDS[1], tmp_path, RUN_DIR=vllm_run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"settings not given as flags come from the run's {vllm_run / 'config.yaml'}" in (
        done.stdout
    )
    assert "converting the Megatron checkpoint" in done.stdout  # its newest checkpoint
    settings = json.loads((tmp_path / "results.json").read_text())["settings"]
    # configs/tiny_cpu.yaml: the vLLM engine, 16 new tokens (eval.max_tokens) in 64, the
    # problem text alone (model.chat_template=plain)
    assert settings["engine"] == "vllm" and settings["chat_template"] == "plain"
    assert (settings["max_tokens"], settings["max_model_len"]) == (16, 64)
    assert settings["max_prompt_tokens"] == 48 and settings["dtype"] == "float32"


def test_the_documented_command_with_its_own_length_stops_before_the_engine(short_model, tmp_path):
    done = run_documented(COMMANDS[2], tmp_path, MODEL=short_model)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip() == (
        "error: --max-prompt-tokens=1024 + --max-tokens=3584 = 4608 tokens exceed the model's "
        "max_position_embeddings=1536: lower --max-tokens to 512 or less, or --max-prompt-tokens"
    )
    assert not (tmp_path / "results.json").exists()


def _evaluate_cmd(model_dir, out, *extra) -> list[str]:
    """tools/evaluate.py on a tiny model: 8 new tokens, fp32, `extra` arguments."""
    fixed = ["--max-tokens", "8", "--max-model-len", "4096", "--dtype", "float32"]
    return [
        sys.executable,
        str(TOOL),
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
        *fixed,
        *extra,
    ]


def test_evaluate_cli_rejects_unknown_benchmark(tmp_path):
    cmd = [sys.executable, str(TOOL), "--model-dir", str(tmp_path), "--benchmarks", "gsm8k"]
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


def test_evaluate_scores_a_plugin_benchmark_with_its_scorer(short_model, tmp_path):
    """examples/plugins/toy_benchmark.py: its schema reads the JSONL file, integer_answer
    scores it, and a shipped benchmark beside it keeps math-verify."""
    from cwgrpo_megatron.reward import first_integer

    out = tmp_path / "toy.json"
    plugin = ROOT / "examples" / "plugins" / "toy_benchmark.py"
    cmd = _evaluate_cmd(short_model, out, "--engine", "torch", "--plugin", str(plugin))
    cmd += [
        "--benchmarks",
        "toy_sums,aime24",
        "--limit",
        "3",
        "--n",
        "2",
        "--max-model-len",
        "1536",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["summary"]["toy_sums"]["problems"] == 3
    toy = [s for s in result["samples"] if s["benchmark"] == "toy_sums"]
    assert len(toy) == 6 and {s["answer"] for s in toy} == {"74", "30", "50"}
    for sample in toy:
        expected = float(first_integer(sample["completion"]) == int(sample["answer"]))
        assert sample["score"] == expected, sample
    assert result["settings"]["plugin"] == [str(plugin)]
