"""Run a function on N gloo processes and collect what each returns, on a pool that lives for
the whole pytest run.

A new process pays the torch + Megatron + transformers import (seconds on 2 cores), and the
suite calls `run_distributed` about a hundred times. So each world size gets one pool of worker
processes, started on first use and ended when pytest exits, and the workers are forked from a
server that has made those imports once. Each task starts as it would in a fresh process:

- a default process group of its own, on a new port, destroyed afterwards together with every
  group made on it (Megatron's parallel state is torn down first);
- the process-wide state a task may change put back as the worker had it when it started:
  environment, working folder, `sys.path`, torch's default seed, dtype, thread count and grad
  mode, warning filters (and so the once-per-location registries), logging handlers, and the
  SIGINT / SIGTERM handlers.

A failure or a time-out on any rank ends that pool (its other ranks may be blocked in a
collective with the rank that failed), raises here with the worker's traceback, and the next
call starts a new pool. So does a worker left with more than `_MAX_THREADS` threads after a
task (gloo threads that outlive their group). A worker whose pytest process is gone exits by
itself.

`CWGRPO_HARNESS_LOG=FILE` appends a line per task (its seconds, the busiest worker's threads
afterwards) and per pool start and end: where a run's time goes.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cwgrpo_megatron.common.processes import free_port

TOOLS = Path(__file__).resolve().parents[2] / "tools"
_POLL_S = 2.0  # how often an idle worker checks that its pytest process is still there
# A worker starts with ~5 threads. `_teardown` frees the groups that tasks are known to leave
# behind; a group held where it cannot reach keeps 3 gloo threads. Idle, they cost little
# (200 of them: 0.05 of a core per worker, measured), but they add up over a run: a pool whose
# worker has more than this after a task is replaced before the next one.
_MAX_THREADS = 256
# A file to append one line per task and per pool start / end to (how the suite spends its time)
_LOG = os.environ.get("CWGRPO_HARNESS_LOG")


def _log(line: str) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


class _FreshState:
    """What a task may change in its process, captured when the worker starts."""

    def __init__(self) -> None:
        import torch

        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.seed = torch.initial_seed()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.root_handlers = list(logging.root.handlers)
        self.root_level = logging.root.level
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        import torch

        if dict(os.environ) != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.manual_seed(self.seed)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)
        for handler in logging.root.handlers:
            if handler not in self.root_handlers:
                handler.close()
        logging.root.handlers[:] = self.root_handlers
        logging.root.setLevel(self.root_level)
        for sig, handler in self.signals.items():
            signal.signal(sig, handler)


def _teardown() -> None:
    import torch.distributed as dist

    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        _drop_megatron_references(parallel_state)
    if dist.is_initialized():  # an in-process vLLM engine may already have ended it
        dist.destroy_process_group()
    _clear_kept_tracebacks()
    # a gloo group's threads live until its last reference goes, and models hold theirs in
    # reference cycles: without a collection every task leaves ~30 busy threads behind
    gc.collect()


def _clear_kept_tracebacks() -> None:
    """Free the task's frames that an exception kept in a module global still holds.

    A module imported during a task that keeps an import error for later (vLLM's
    `multimodal.media.audio._torchcodec_import_exc`) keeps its traceback. The traceback's
    frames keep their callers (`f_back`), up to the task's function and everything it held:
    a trainer, its model and its groups. Clearing the locals of the frames that have finished
    lets them go; the error keeps its message and lines.
    """
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            seen = set()  # a chain of causes can loop
            while isinstance(value, BaseException) and id(value) not in seen:
                seen.add(id(value))
                tb = value.__traceback__
                frame = tb.tb_frame if tb is not None else None
                while frame is not None:
                    with contextlib.suppress(RuntimeError):  # still running: the worker's loop
                        frame.clear()
                    frame = frame.f_back
                if tb is not None:
                    traceback.clear_frames(tb)
                value = value.__cause__ or value.__context__


def _drop_megatron_references(parallel_state) -> None:
    """Let go of the groups that Megatron keeps past `destroy_model_parallel`.

    Three holders, found by walking `gc` back from the groups a task left (each gloo group
    keeps 2-3 threads until its last reference goes):
    - globals that `destroy_model_parallel` does not reset (0.16.1:
      `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP[_GLOO]`);
    - `functools.lru_cache`s on Megatron methods, e.g. `RotaryEmbedding.forward`, which keep
      their `self`, and with it the module's context-parallel group;
    - `DistributedDataParallel`'s gradient hooks: each parameter's gradient accumulator (a
      C++ autograd node, which `gc` cannot see into) holds a hook that holds the DDP wrapper,
      which holds the parameters: a cycle that is never collected. Emptying the wrapper's
      attributes (the task is over) breaks it.
    """
    import functools

    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel

    def holds_group(value) -> bool:
        if isinstance(value, list | tuple):
            return any(holds_group(v) for v in value)
        return isinstance(value, dist.ProcessGroup)

    for name, value in list(vars(parallel_state).items()):
        if holds_group(value):
            setattr(parallel_state, name, None)
    for obj in gc.get_objects():
        if isinstance(obj, functools._lru_cache_wrapper):
            if str(getattr(obj, "__module__", "")).startswith("megatron."):
                obj.cache_clear()
        elif isinstance(obj, DistributedDataParallel):
            vars(obj).clear()


def _threads() -> int:
    """Threads of this process, native ones (gloo's, OpenMP's) included; 0 without /proc."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its number reused by another user
        return False
    return True


def _serve(rank: int, world_size: int, parent: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # what nearly every task imports (already in memory when the fork server preloaded it)
    import megatron.core.parallel_state  # noqa: F401
    import transformers  # noqa: F401

    fresh = _FreshState()
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if not _alive(parent):  # the pytest process is gone (our parent is the fork server)
                return
            continue
        if task is None:
            return
        fn, args, port = task
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=60),
            )
            with warnings.catch_warnings():
                result = fn(rank, world_size, *args)
            status, payload = "ok", result
        except BaseException:
            status, payload = "error", traceback.format_exc()
        try:
            _teardown()
        finally:
            fresh.restore()
        results.put((rank, status, payload, _threads()))


# Workers start from a fork server that has imported these once: a worker begins with them in
# memory instead of paying the torch + Megatron + transformers import again (about 6 s of CPU
# per worker on 2 cores; `make test` starts 17, more after a failed task). The server is a fresh
# interpreter that imports only these and never runs a task, so a worker inherits no thread,
# group or engine.
_PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "transformers", __name__]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first pool)
    return ctx


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        # not daemonic: tasks start vLLM engine processes and other children of their own
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, os.getpid(), self.tasks[r], self.results),
                name=f"harness-{world_size}-{r}",
            )
            for r in range(world_size)
        ]
        t0 = time.monotonic()
        for p in self.procs:
            p.start()
        self.worn = False
        _log(f"pool {world_size} start {time.monotonic() - t0:.1f}s")

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list:
        port = free_port()
        for q in self.tasks:
            q.put((fn, args, port))
        start = time.monotonic()
        deadline = start + timeout
        out: dict[int, Any] = {}
        most = 0  # threads of the busiest worker after this task
        while len(out) < self.world_size:
            left = deadline - time.monotonic()
            try:
                rank, status, payload, threads = self.results.get(timeout=max(left, 0.01))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(out))
                raise TimeoutError(
                    f"{fn.__qualname__} on {self.world_size} processes did not finish in "
                    f"{timeout:.0f} s (no result from rank(s) {missing})"
                ) from None
            if status != "ok":
                raise RuntimeError(f"distributed worker failed\nrank {rank}:\n{payload}")
            out[rank] = payload
            most = max(most, threads)
        self.worn = most > _MAX_THREADS
        _log(
            f"task {self.world_size} {fn.__module__}.{fn.__qualname__} "
            f"{time.monotonic() - start:.1f}s threads={most}"
        )
        return [out[r] for r in range(self.world_size)]

    def close(self, *, wait: float) -> None:
        t0 = time.monotonic()
        if wait:
            for q in self.tasks:
                q.put(None)
        deadline = time.monotonic() + wait
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
            if p.is_alive():
                p.kill()
                p.join()
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()
        _log(f"pool {self.world_size} close {time.monotonic() - t0:.1f}s")


_POOLS: dict[int, _Pool] = {}


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout: float = 180) -> list:
    """`fn(rank, world_size, *args)` on `world_size` processes; returns results by rank.

    `fn` must be a module-level function (it is pickled into the workers), and so must what it
    returns. A failure on any rank raises here with that rank's traceback; so does a run past
    `timeout` seconds. Either ends the pool, which the next call starts again.
    """
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        out = pool.run(fn, args, timeout)
    except BaseException:
        del _POOLS[world_size]
        pool.close(wait=0)
        raise
    if pool.worn:
        del _POOLS[world_size]
        pool.close(wait=10)
    return out


def _tool_main(rank: int, world_size: int, tool: str, argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io
    import runpy

    # what torchrun would have set (the harness puts the environment back afterwards)
    ranks = dict(RANK=rank, LOCAL_RANK=rank, GROUP_RANK=0, MASTER_ADDR="127.0.0.1")
    sizes = dict(WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=world_size)
    os.environ.update({k: str(v) for k, v in {**ranks, **sizes}.items()})
    main = runpy.run_path(str(TOOLS / tool), run_name=f"tools.{tool}")["main"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def run_tool(tool: str, world_size: int, *argv: str, timeout: float = 600) -> tuple[int, str]:
    """(exit code, output) of `tools/<tool>`'s `main(argv)` on `world_size` ranks: what
    `torchrun --nproc-per-node world_size tools/<tool> *argv` gives, without the launch. The
    code is the largest of the ranks' codes; the output is every rank's stdout and stderr, in
    rank order.
    """
    ranks = run_distributed(_tool_main, world_size, tool, list(argv), timeout=timeout)
    return max(code for code, _ in ranks), "".join(log for _, log in ranks)


def close_pools() -> None:
    """End every pool (pytest's session end, and at exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close(wait=10)


atexit.register(close_pools)
