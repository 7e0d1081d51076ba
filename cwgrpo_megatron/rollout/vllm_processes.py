"""The supervision of a vLLM engine's processes: where they start (GPUs, cores), the record
that lets the next start kill the ones a dead trainer left, and the watchdog that turns their
death mid-call into an error.

    started(devices, cpu_cores, tp)  CUDA_VISIBLE_DEVICES and VLLM_CPU_OMP_THREADS_BIND for a start
    record_engine_processes()     this process's children, written to ENGINE_RECORDS
    kill_orphaned_engines()       SIGKILL the processes of recorded trainers that are gone
    watched(llm, rank)            vLLM's EngineDeadError, or a death it never reports, as ours
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch

from cwgrpo_megatron.rollout import placement
from cwgrpo_megatron.rollout.base import EngineDeadError

log = logging.getLogger(__name__)

ENGINE_RECORDS = Path(tempfile.gettempdir()) / "cwgrpo-engines"
"""One JSON file per trainer process that owns engine processes: {pid: create_time} of each.
vLLM renames its processes (setproctitle), which wipes their visible environment, so they are
recorded rather than searched for."""
WATCHDOG_S = 0.5
"""How often a waiting call checks whether its engine processes were marked dead."""


def stop_engine_processes(llm, record: Path) -> None:
    llm.llm_engine.engine_core.shutdown()
    record.unlink(missing_ok=True)


def record_engine_processes() -> tuple[Path, list[int]]:
    """Write this process's children (the engine processes just started) to its record; the
    record and their pids."""
    procs = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            procs[child.pid] = child.create_time()
    ENGINE_RECORDS.mkdir(exist_ok=True)
    record = ENGINE_RECORDS / f"{os.getpid()}.json"
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps(procs))
    tmp.replace(record)
    return record, list(procs)


def kill_orphaned_engines() -> int:
    """SIGKILL the engine processes recorded by trainers that are gone (a SIGKILLed trainer
    leaves them running, about 1.5 GB each); returns how many were killed."""
    killed = 0
    for record in ENGINE_RECORDS.glob("*.json") if ENGINE_RECORDS.is_dir() else []:
        if psutil.pid_exists(int(record.stem)):
            continue
        try:
            procs = json.loads(record.read_text())
        except (OSError, ValueError):
            procs = {}
        for pid, created in procs.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(pid))
                if abs(proc.create_time() - created) < 1e-3:  # not a reused pid
                    log.warning(
                        "killing engine process %s left by dead trainer %s", pid, record.stem
                    )
                    proc.send_signal(signal.SIGKILL)
                    killed += 1
        record.unlink(missing_ok=True)
    return killed


@contextlib.contextmanager
def started(devices: list[int] | None, cpu_cores: Sequence[int] | None, tp: int):
    """The environment engine processes inherit while they start, restored afterwards:
    CUDA_VISIBLE_DEVICES narrowed to `devices` (indices into what is visible now; None: all),
    and VLLM_CPU_OMP_THREADS_BIND set to `cpu_cores` (None: unbound) for `tp` workers."""
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")}
    if devices is not None and torch.cuda.is_available():
        before = saved["CUDA_VISIBLE_DEVICES"]
        visible = (
            before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
        )
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in devices)
    if cpu_cores is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = placement.omp_bind(cpu_cores, tp)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def watched(llm, *, rank: int, in_process: bool):
    """vLLM's EngineDeadError as ours, with what to do about it. vLLM 0.32's client waits
    forever for engine processes that die mid-call (its monitor marks the engine dead and
    stops the output thread without a word to a waiting request or RPC), so a watchdog
    hands the waiting call vLLM's own error once the engine is marked dead; it writes into the
    client's queue of outputs and its pending RPC futures, which vLLM reads next. Nothing to
    watch in-process."""
    from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

    done = threading.Event()
    if not in_process:
        client = llm.llm_engine.engine_core

        def watch() -> None:
            while not done.wait(WATCHDOG_S):
                if client.resources.engine_dead:
                    client.outputs_queue.put_nowait(VLLMEngineDead())  # a request
                    for future in list(client.utility_results.values()):  # an RPC
                        if not future.done():
                            future.set_exception(VLLMEngineDead())
                    return

        threading.Thread(target=watch, daemon=True, name="cwgrpo-engine-watchdog").start()
    try:
        yield
    except VLLMEngineDead as err:
        raise EngineDeadError(
            f"the vLLM engine processes of rank {rank} died (a crash, the OOM killer or a "
            "kill; vLLM's log above says which): start the run again, it resumes from its "
            "last checkpoint"
        ) from err
    finally:
        done.set()
