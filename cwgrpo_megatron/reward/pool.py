"""A process pool whose tasks have a wall-clock limit: an overrunning worker is killed.

math-verify guards itself with `signal.alarm`, which works only in a main thread, so
verification runs in worker processes with math-verify's own timeouts off, and this pool
enforces the limit from outside. Tasks go to workers in chunks, topped up before a worker runs
dry (millisecond-sized tasks would otherwise wait on pipe round trips); a worker answers each
task as it finishes, and the limit applies to each task: the clock restarts at every answer.
A task still running after `timeout_s` is answered with the pool's default, its worker is
SIGKILLed and replaced, and the rest of its chunk goes back to the queue. Nothing is raised for
a slow or failing task; counts of each outcome are kept.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

MAX_CHUNK = 16


def _serve(fn: Callable, conn) -> None:
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for index, args in chunk:
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
        self.in_flight: deque[int] = deque()  # task indices sent, in the order they run
        self.deadline = 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class TimeoutPool:
    """`map(tasks)` runs `fn(*args)` for each args tuple on `workers` processes, each task
    limited to `timeout_s` seconds. Results come back in order; a task that raises or
    overruns yields `default`."""

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
        pending = deque(range(len(tasks)))
        while pending or any(w.in_flight for w in self._workers):
            for worker in list(self._workers):
                # top up before the worker runs dry, so it never waits for the dispatcher
                if len(worker.in_flight) <= MAX_CHUNK // 2 and pending:
                    size = max(1, min(MAX_CHUNK, len(pending) // len(self._workers)))
                    chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                    self._send(worker, chunk, tasks)
            busy = {w.conn: w for w in self._workers if w.in_flight}
            timeout = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for conn in wait(list(busy), timeout=timeout):
                self._receive(busy[conn], results, pending)
            now = time.monotonic()
            for worker in [w for w in self._workers if w.in_flight and w.deadline <= now]:
                self.stats.timeouts += 1
                self._fail(worker, pending)
        return results

    def _send(self, worker: _Worker, chunk: list[int], tasks: Sequence[tuple]) -> None:
        payload = [(i, tasks[i]) for i in chunk]
        try:
            worker.conn.send(payload)
        except (BrokenPipeError, OSError):  # it died while idle: use a fresh one
            worker = self._replace(worker)
            worker.conn.send(payload)
        if not worker.in_flight:  # otherwise the clock belongs to the task now running
            worker.deadline = time.monotonic() + self.timeout_s
        worker.in_flight.extend(chunk)

    def _receive(self, worker: _Worker, results: list, pending: deque) -> None:
        try:
            index, status, value = worker.conn.recv()
        except (EOFError, OSError):  # the worker died under its running task
            self.stats.errors += 1
            self._fail(worker, pending)
            return
        worker.in_flight.remove(index)
        worker.deadline = time.monotonic() + self.timeout_s  # the next task's clock starts now
        self.stats.done += 1
        self._failures_in_a_row = 0
        if status == "ok":
            results[index] = value
        else:
            self.stats.errors += 1
            if len(self.stats.error_examples) < 5:
                self.stats.error_examples.append(value)

    def _fail(self, worker: _Worker, pending: deque) -> None:
        """Drop the running task (it keeps the default), re-queue the rest, replace the worker."""
        worker.in_flight.popleft()
        pending.extendleft(reversed(worker.in_flight))
        worker.in_flight.clear()
        self._replace(worker)

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


class CallTimeout(TimeoutError):
    """A timed call did not return within its limit (or one that did not is still running)."""


class TimedCalls:
    """Calls of a function under a wall-clock limit, each in a daemon thread: a call past
    `timeout_s` raises `CallTimeout` and is left running (a thread cannot be stopped), and
    while it runs, later calls raise `CallTimeout` at once, so that the function never runs
    twice at the same time. A call that raises re-raises here."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._overrun: threading.Thread | None = None

    def __call__(self, fn: Callable, /, **kwargs) -> Any:
        if self._overrun is not None and self._overrun.is_alive():
            raise CallTimeout(f"its call that overran {self.timeout_s} s is still running")
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn(**kwargs)
            except BaseException as err:  # handed to the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=run, name="timed-reward-call", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._overrun = thread
            raise CallTimeout(f"it did not return within {self.timeout_s} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
