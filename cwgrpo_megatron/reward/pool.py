"""A process pool whose tasks have a wall-clock limit: an overrunning worker is killed.

math-verify guards itself with `signal.alarm`, which works only in a main thread, so
verification runs in worker processes with math-verify's own timeouts off, and this pool
enforces the limit from outside: a task still running after `timeout_s` is answered with the
pool's default, its worker is SIGKILLed and replaced. Nothing is raised for a slow or failing
task; counts of each outcome are kept.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any


def _serve(fn: Callable, conn) -> None:
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, args = task
        try:
            conn.send((index, "ok", fn(*args)))
        except Exception as err:  # a bad input must not take the worker down
            conn.send((index, "error", f"{type(err).__name__}: {err}"))


@dataclass
class PoolStats:
    done: int = 0
    errors: int = 0
    timeouts: int = 0
    restarts: int = 0
    error_examples: list[str] = field(default_factory=list)


class _Worker:
    def __init__(self, ctx, fn: Callable) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(fn, child), daemon=True)
        self.proc.start()
        child.close()
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class TimeoutPool:
    """`map(args_list)` runs `fn(*args)` on `workers` processes with a per-task time limit.

    Results come back in order; a task that raises or overruns yields `default`.
    """

    def __init__(
        self, fn: Callable, *, workers: int = 2, timeout_s: float = 5.0, default: Any = None
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.fn, self.timeout_s, self.default = fn, timeout_s, default
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, fn) for _ in range(workers)]
        self.stats = PoolStats()
        self._failures_in_a_row = 0

    def map(self, tasks: Sequence[tuple]) -> list:
        results = [self.default] * len(tasks)
        pending = list(range(len(tasks)))[::-1]
        busy: dict[Any, _Worker] = {}
        while pending or busy:
            for worker in list(self._workers):
                if worker.task is None and pending:
                    index = pending.pop()
                    used = self._send(worker, index, tasks[index])
                    busy[used.conn] = used
            timeout = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for conn in wait(list(busy), timeout=timeout):
                worker = busy.pop(conn)
                try:
                    index, status, value = conn.recv()
                except (EOFError, OSError):  # the worker died under the task
                    self._replace(worker)
                    self.stats.errors += 1
                    continue
                worker.task = None
                self.stats.done += 1
                self._failures_in_a_row = 0
                if status == "ok":
                    results[index] = value
                else:
                    self.stats.errors += 1
                    if len(self.stats.error_examples) < 5:
                        self.stats.error_examples.append(value)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if worker.deadline <= now:
                    del busy[conn]
                    self.stats.timeouts += 1
                    self._replace(worker)
        return results

    def _send(self, worker: _Worker, index: int, args: tuple) -> _Worker:
        """Start task `index` on `worker` (or on its replacement if it died while idle)."""
        try:
            worker.conn.send((index, args))
        except (BrokenPipeError, OSError):
            worker = self._replace(worker)
            worker.conn.send((index, args))
        worker.task = index
        worker.deadline = time.monotonic() + self.timeout_s
        return worker

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self._failures_in_a_row += 1
        if self._failures_in_a_row > 2 * len(self._workers) + 2:
            self.close()
            raise RuntimeError(
                "verification workers keep dying before finishing any task: a worker cannot "
                "start (is the main module guarded by `if __name__ == '__main__':`?) or every "
                "task crashes it"
            )
        fresh = _Worker(self._ctx, self.fn)
        self._workers[self._workers.index(worker)] = fresh
        self.stats.restarts += 1
        return fresh

    def close(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.conn.send(None)
            worker.proc.join(timeout=2)
            if worker.proc.is_alive():
                worker.proc.kill()
        self._workers = []

    def __enter__(self) -> TimeoutPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
