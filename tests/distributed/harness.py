"""Run a function on N gloo processes and collect what each returns, on a pool that lives for
the whole pytest run.

A new process pays the torch + Megatron + transformers import (seconds on 2 cores), and the
suite calls `run_distributed` about a hundred times. So each world size gets one pool of worker
processes, started on first use and ended when pytest exits. Each task starts as it would in a
fresh process:

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
"""

from __future__ import annotations

import atexit
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

from cwgrpo_megatron.megatron.launch import free_port

TOOLS = Path(__file__).resolve().parents[2] / "tools"
_POLL_S = 2.0  # how often an idle worker checks that its pytest process is still there
# A worker starts with ~5 threads. Some groups' gloo threads outlive their task (held where a
# collection cannot reach them), and hundreds of them slow every process on 2 cores; a pool
# whose worker has more than this after a task is replaced before the next one.
_MAX_THREADS = 48


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
    if dist.is_initialized():  # an in-process vLLM engine may already have ended it
        dist.destroy_process_group()
    # a gloo group's threads live until its last reference goes, and models hold theirs in
    # reference cycles: without a collection every task leaves ~30 busy threads behind
    gc.collect()


def _threads() -> int:
    """Threads of this process, native ones (gloo's, OpenMP's) included; 0 without /proc."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _serve(rank: int, world_size: int, parent: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # what nearly every task imports, paid once per worker instead of once per task
    import megatron.core.parallel_state  # noqa: F401
    import transformers  # noqa: F401

    fresh = _FreshState()
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
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


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
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
        for p in self.procs:
            p.start()
        self.worn = False

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list:
        port = free_port()
        for q in self.tasks:
            q.put((fn, args, port))
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
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
            self.worn |= threads > _MAX_THREADS
        return [out[r] for r in range(self.world_size)]

    def close(self, *, wait: float) -> None:
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
