"""One-step-off rollouts (rollout.async_steps=1) with the engine on a core of its own
(rollout.placement=separate, rollout.cpu_cores=1): real vLLM engine processes, real
Megatron-Core, the tiny random Qwen2 of configs/tiny_cpu.yaml with 32-token completions (so
that step 1's groups have a reward signal and the policy moves).

Step k+1's rollouts are generated in the background while step k trains, with the weights
after step k-1; the engine's call trace proves the order, and the gap between the engine's
sampling log-probs and the trainer's proves the lag. A run SIGKILLed in step 2 at DP2 and
resumed has the one-process run's completions and values."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from cwgrpo_megatron.common.processes import free_port
from tests.e2e.test_train import (
    KILL_SCRIPT,
    LAUNCHER,
    MODULE,
    check_run_folder,
    launch,
    metrics,
    python_train,
    run_args,
    same_run_as,
    torchrun,
    train_args,
)
from tests.engine_calls import replica_calls
from tests.once import build_once

ASYNC = (
    "rollout.placement=separate",
    "rollout.async_steps=1",
    "data.max_prompt_tokens=32",
    "rollout.max_tokens=32",
    "reward.options.cosine_length.max_len=32",
    "run.verify_sync=1",
    "run.trace_engine=true",
)


def gen(step: int) -> tuple:
    return (step, "generate", None, None)


def load(step: int) -> tuple:
    return (step, "load", None, None)


# step 2's rollouts are generated before step 1's weights are loaded, step 3's before step
# 2's; the last step makes none ahead, and its evaluation runs after its sync
CALLS = [gen(1), gen(2), load(1), gen(3), load(2), load(3), gen(3)]


def processes_of_run(out: Path) -> list[psutil.Process]:
    """The live processes started with CWGRPO_TEST_RUN=out in their environment."""
    time.sleep(1)  # a parent-death signal is delivered at once; give the kernel a moment
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("CWGRPO_TEST_RUN") == str(out) and proc.status() != "zombie":
                found.append(proc)
    return found


@pytest.fixture(scope="session")
def async_run(tiny, tmp_path_factory) -> tuple[Path, str]:
    """The reference: 3 one-step-off steps in one process, a checkpoint every step (built once
    per session, `tests/once.py`); its folder and its output."""

    def build(folder: Path) -> tuple[Path, str]:
        out = folder / "run"
        code, log = launch(python_train(tiny, out, *ASYNC))
        assert code == 0, log
        return out, log

    return build_once(tmp_path_factory, "async_run", build)


def test_async_run_samples_each_step_with_the_weights_before_the_last_update(async_run):
    out, log = async_run
    rows = check_run_folder(out, 3)
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert "rank 0 on cores [0], its engine on cores [1]" in log
    assert "weight sync path: shm" in log  # on CPU a separate engine reads /dev/shm
    # step 1 samples with the weights it trains (fp32 on both sides); steps 2 and 3 with the
    # weights before the previous update, which moved the policy
    assert rows[0]["actor/grad_norm"] > 0
    assert rows[0]["rollout/gap_mean"] < 1e-5
    assert all(r["rollout/gap_mean"] > 1e-3 for r in rows[1:]), rows
    assert replica_calls(out / "engine_calls.jsonl", 0) == CALLS
    # the checkpoint after step 2 holds step 3's scored groups; the last one holds none
    ahead = torch.load(
        out / "checkpoints" / "step_00000002" / "data_objects.pt", weights_only=False
    )["ahead"]
    assert ahead.policy_step == 1 and sorted(g.position for g in ahead.scored) == [0, 1, 2, 3]
    assert not (out / "checkpoints" / "step_00000003" / "data_objects.pt").exists()


def test_sigkill_in_step_2_at_dp2_then_resume_is_the_uninterrupted_run(async_run, tiny, tmp_path):
    """Killed in step 2's update: step 1's checkpoint holds step 2's rollouts, made during
    step 1 with the start weights. The resumed run trains on them and makes step 3's with the
    weights after step 1, as the uninterrupted run did."""
    reference, _ = async_run
    out = tmp_path / "run"
    kill = [str(KILL_SCRIPT), "in-step", "2", *train_args(tiny, out, *ASYNC)]
    code, log = launch([*torchrun(2), *kill], env={"CWGRPO_TEST_RUN": str(out)})
    assert code == 1, log  # torchrun's exit when its workers are SIGKILLed
    # what the killed ranks started dies with them (Megatron's checkpoint Manager included),
    # but their engines, which the next run stops (`kill_orphaned_engines`), and the
    # multiprocessing resource tracker that the engines hold open
    left = [
        " ".join(p.cmdline())
        for p in processes_of_run(out)
        if not p.name().startswith("VLLM::") and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert not left, left
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert (out / "checkpoints" / "step_00000001" / "data_objects.pt").is_file()
    killed = replica_calls(out / "engine_calls.jsonl", 0)
    # killed when step 2's update began: step 3's generation may have started or not
    assert killed in (CALLS[:3], CALLS[:4]), killed
    env = {"NNODES": "1", "GPUS_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    resume = ["bash", str(LAUNCHER), *run_args(tiny, out, *ASYNC, "run.resume=auto")]
    code, log = launch(resume, env=env)
    assert code == 0, log
    assert "resumed from" in log and "at step 1" in log
    assert not processes_of_run(out), "the killed run left processes past the resumed one"
    rows = metrics(out)
    assert json.loads((out / "env.json").read_text())["layout"]["dp"] == 2
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0]
    same_run_as(out, rows, reference)
    # the fresh engine takes step 1's weights, then makes step 3's rollouts during step 2
    assert replica_calls(out / "engine_calls.jsonl", 0)[len(killed) :] == [load(1), *CALLS[3:]]


def test_an_engine_killed_during_the_background_generation_stops_the_run(tiny, tmp_path):
    """The engine dies once step 1's checkpoint is written: while step 2 trains and step 3's
    rollouts are generated in the background. The run stops with the engine's error, and the
    checkpoint is whole."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", MODULE, *train_args(tiny, out, *ASYNC, "train.total_steps=4")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "log", "w+") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        killed, started = [], time.monotonic()
        try:
            while proc.poll() is None and time.monotonic() - started < 300:
                if not killed and (out / "checkpoints" / "step_00000001").is_dir():
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            if child.name() == "VLLM::EngineCore":
                                child.send_signal(signal.SIGKILL)
                                killed.append(child.pid)
                time.sleep(0.05)
            code = proc.wait(timeout=5)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        log.seek(0)
        text = log.read()
    assert killed, text
    assert code == 1, text
    died = "[rank 0] error: the vLLM engine processes of rank 0 died"
    assert died in text, text
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[0] == "step_00000001" and all(n.startswith("step_") for n in saved), saved
    assert [r["step"] for r in metrics(out)] == list(range(1, len(saved) + 1))
