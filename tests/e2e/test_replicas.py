"""Rollout engine replicas across two "nodes": two torchrun launches side by side on this
machine (`--nnodes 2 --node-rank {0,1}`), each with 2 processes and one vLLM engine, against
one process with one engine. Tiny random Qwen2, configs/tiny_cpu.yaml.
Both trace their engines' calls at rollout.sleep_level=2 (traced on CPU, where it frees
nothing), and evaluate after the last step: the two engines' evaluation equals the one's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from cwgrpo_megatron.common.processes import free_port
from tests.e2e.test_train import (
    LAUNCHER,
    ONE_THREAD,
    launch,
    metrics,
    python_train,
    run_args,
    same_run_as,
)
from tests.engine_calls import expected_calls, replica_calls
from tests.once import build_once

ARGS = (
    "run.verify_sync=1",
    "train.total_steps=2",
    "run.trace_engine=true",
    "rollout.sleep_level=2",
)
STEPS = expected_calls([1, 2], 2, eval_steps=[2])  # the last step evaluates


def launch_nodes(
    nnodes: int, nproc: int, args: list[str] | list[list[str]], *, timeout=480, watch=None
):
    """Run the launcher under `nnodes` torchrun launches of `nproc` processes side by side,
    with `args` (or args[node] for each); [(exit code, output)] per launch (124: still running
    at `timeout`). `watch(procs)` is called every 0.2 s while they run (the kill test's hook)."""
    per_node = args if isinstance(args[0], list) else [args] * nnodes
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    port, procs = free_port(), []
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(nnodes)]
        for node, out in enumerate(outs):
            cmd = ["torchrun", "--nnodes", str(nnodes), "--node-rank", str(node)]
            cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
            cmd += ["--nproc-per-node", str(nproc), str(LAUNCHER), *per_node[node]]
            procs.append(
                subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
        deadline, codes = time.monotonic() + timeout, [None] * nnodes
        try:
            while None in codes and time.monotonic() < deadline:
                codes = [p.poll() for p in procs]
                if watch is not None:
                    watch(procs)
                time.sleep(0.2)
        finally:  # torchrun's workers lead sessions of their own: kill every descendant
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    for child in psutil.Process(p.pid).children(recursive=True):
                        child.kill()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        results = []
        for code, out in zip(codes, outs, strict=True):
            out.seek(0)
            results.append((124 if code is None else code, out.read()))
    return results


@pytest.fixture(scope="session")
def one_process(tiny, tmp_path_factory) -> Path:
    """The reference: one process, one engine, built once per session (`tests/once.py`). The
    replicas must train like it whatever their layout: the same completions at every step and
    every value within the fp32 order of its sums (`same_run_as`)."""

    def build(folder: Path) -> Path:
        out = folder / "run"
        code, log = launch(python_train(tiny, out, *ARGS))
        assert code == 0, log
        assert "1 engine replicas" in log
        # the engine sleeps after its rollouts, its weights wake for the sync, its KV cache
        # after it; the evaluation comes when it is awake again
        assert replica_calls(out / "engine_calls.jsonl", 0) == STEPS
        return out

    return build_once(tmp_path_factory, "one_process", build)


def _two_nodes(tiny, out: Path, *extra: str) -> list[dict]:
    runs = launch_nodes(2, 2, run_args(tiny, out, *extra, *ARGS))
    for code, log in runs:
        assert code == 0, log
    assert "2 engine replicas (owners: ranks 0, 2) on 2 nodes" in runs[0][1]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for replica in (0, 1):  # each owner traces its own engine, into the one file
        assert replica_calls(out / "engine_calls.jsonl", replica) == STEPS, replica
    # run.verify_sync=1: after every sync each replica's engine scores like the trainer
    assert all(r["sync/gap"] <= r["sync/tol"] == 1e-4 for r in rows), rows
    return rows


def _same_run(rows: list[dict], reference: Path, out: Path) -> None:
    """The same completions and metrics as the one-process run, and the same evaluation."""
    same_run_as(out, rows, reference)
    # the evaluation split over both engines: the same completions, scores and summary as one
    # engine's (its seeds go with the problems)
    ours, one = (
        json.loads((run / "eval" / "step_00000002.json").read_text()) for run in (out, reference)
    )
    assert len(one["samples"]) == 16 and ours == one  # 8 held-out problems x 2


def test_tp2_in_each_node_dp2_across_two_replicas_train_like_one_process(
    tiny, one_process, tmp_path
):
    out = tmp_path / "run"
    rows = _two_nodes(tiny, out, "parallel.tp=2")
    # each node holds a whole model copy: its ranks write their shards, nothing crosses nodes
    assert [r["sync/received_mb"] for r in rows] == [0.0, 0.0]
    _same_run(rows, one_process, out)


def test_pp2_across_nodes_sends_each_node_the_other_stage(tiny, one_process, tmp_path):
    from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint

    out = tmp_path / "run"
    rows = _two_nodes(tiny, out, "parallel.pp=2")
    ckpt = HFCheckpoint(str(tiny))
    stage = {0: 0, 1: 0}  # bytes of each pipeline stage's HF tensors (2 layers, one a stage)
    for name in ckpt.names():
        layer = name.split(".")[2] if ".layers." in name else None
        first = "embed" in name or layer == "0"
        stage[0 if first else 1] += ckpt.get(name).numel() * 4
    # node 0 holds stage 0 and receives stage 1, node 1 the other way round; the metric is
    # the larger of the two, measured on the receiving ranks
    assert [r["sync/received_mb"] for r in rows] == [max(stage.values()) / 2**20] * 2
    _same_run(rows, one_process, out)


def test_a_killed_engine_stops_every_rank_and_keeps_the_checkpoints(tiny, tmp_path):
    out = tmp_path / "run"
    killed = []

    def kill_node1_engine_after_step1(procs):
        if killed or not (out / "checkpoints" / "step_00000001").is_dir():
            return
        for child in psutil.Process(procs[1].pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.name() == "VLLM::EngineCore":
                    child.send_signal(signal.SIGKILL)
                    killed.append(child.pid)

    # one rank a node (DP2 over the nodes), each owning its node's engine
    extra = ("train.total_steps=4", "run.save_every=1", "run.keep_last=4")
    started = time.monotonic()
    runs = launch_nodes(2, 1, run_args(tiny, out, *extra), watch=kill_node1_engine_after_step1)
    assert killed, "node 1's engine was never found"
    assert time.monotonic() - started < 300
    logs = "\n".join(log for _, log in runs)
    assert [code for code, _ in runs] != [0, 0] and 124 not in [c for c, _ in runs], logs
    died = "the vLLM engine processes of rank 1 died"
    errors = {int(line.split()[1][:-1]): line for line in logs.splitlines() if "] error: " in line}
    assert sorted(errors) == [0, 1], logs
    assert errors[1].startswith(f"[rank 1] error: {died}"), errors
    # whichever phase of step 2 the kill hit (rollout, sync, check)
    assert f"failed on rank 1: EngineDeadError: {died}" in errors[0], errors
    # every checkpoint written before the failure is whole, nothing half-written is left, and
    # the metrics hold the saved steps
    from cwgrpo_megatron.megatron.train_checkpoint import STATE_NAME

    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and all(name.startswith("step_") for name in saved), saved
    assert all((out / "checkpoints" / name / STATE_NAME).is_file() for name in saved)
    steps = [r["step"] for r in metrics(out)]
    assert [int(name.removeprefix("step_")) for name in saved] == steps[: len(saved)]


def test_a_node_with_another_model_is_refused_before_the_first_step(tiny, tmp_path):
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    other = save_tiny_qwen2(tmp_path / "other", end_tokens=32, intermediate_size=384)
    out = tmp_path / "run"
    runs = launch_nodes(2, 1, [run_args(tiny, out, *ARGS), run_args(other, out, *ARGS)])
    logs = "\n".join(log for _, log in runs)
    assert [code for code, _ in runs] == [1, 1], logs
    for rank, path in ((0, tiny), (1, other)):
        said = f"[rank {rank}] error: model.path={path} holds another model on rank 1 than on"
        assert said in logs, logs
    assert "ffn_hidden_size: 256 vs 384" in logs and "every node must hold the same" in logs
    assert not (out / "metrics.jsonl").exists() or not metrics(out)


def test_nodes_that_do_not_share_run_out_dir_are_refused_at_start(tiny, tmp_path):
    """Node 1 is given a folder of its own (as node-local disk would be): rank 0 does not see
    its marker and every rank stops before the model is read, leaving no marker behind."""
    shared, local = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    local.mkdir(parents=True)
    wait = "run.shared_dir_wait_s=2"
    runs = launch_nodes(2, 1, [run_args(tiny, out, *ARGS, wait) for out in (shared, local)])
    logs = "\n".join(log for _, log in runs)
    assert [code for code, _ in runs] == [1, 1], logs
    said = (
        f"[rank 0] error: run.out_dir={shared} is not shared by every node: after 2 s rank 0 "
        "sees no marker from node 1 ("
    )
    assert said in logs and "every node mounts at the same path" in logs, logs
    assert "[rank 1] error: checking that run.out_dir is shared failed on rank 0" in logs, logs
    assert list(local.iterdir()) == []
    assert sorted(p.name for p in shared.iterdir()) == ["config.yaml", "eval", "samples"]
