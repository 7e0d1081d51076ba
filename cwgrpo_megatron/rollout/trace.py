"""The engine's calls, one JSON line each, in the run folder (`run.trace_engine`).

    {"step": k, "replica": r, "call": "generate" | "sleep" | "wake" | "load",
     "level": L (sleep; else null), "tags": [...] (wake; else null)}

`load` is a weight sync into the engine (`load_shm`, `load_transfer` or `load_stream`);
`step` is the training step the call belongs to (0 before the first). On CPU, where sleeping
frees nothing, the trace is how the order of a step's calls (docs/design.md, section 4) is
proven.

Each replica's owner appends to the same `engine_calls.jsonl`: one `os.write` of one line on a
file opened with O_APPEND, so lines of owners on one machine do not interleave. A file system
shared across machines need not make appends atomic (NFS does not): there, lines of different
nodes may mix. It is a test and debugging aid, not a record the run reads back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


class TracedEngine:
    """`engine` whose generate, sleep, wake and loads are appended to `path` before they run;
    every other attribute is the engine's own."""

    def __init__(self, engine, path: str | os.PathLike, *, replica: int, step: int = 0) -> None:
        self.engine = engine
        self.path = Path(path)
        self.replica = replica
        self.step = step
        """The step the next calls belong to (`Rollouts.at_step`)."""

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def labeled(self, step: int) -> TracedEngine:
        """The same engine and file, its calls recorded under `step` whatever `self.step`
        becomes (a generation in a background thread belongs to the next step)."""
        return TracedEngine(self.engine, self.path, replica=self.replica, step=step)

    def _write(self, call: str, *, level: int | None = None, tags=None) -> None:
        record = {"step": self.step, "replica": self.replica, "call": call}
        record |= {"level": level, "tags": None if tags is None else list(tags)}
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)

    def generate(self, *args, **kwargs):
        self._write("generate")
        return self.engine.generate(*args, **kwargs)

    def sleep(self, level: int) -> None:
        self._write("sleep", level=level)
        self.engine.sleep(level)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        self._write("wake", tags=("weights", "kv_cache") if tags is None else tags)
        self.engine.wake(tags)

    def load_stream(self, weights) -> None:
        self._write("load")
        self.engine.load_stream(weights)

    def load_shm(self) -> None:
        self._write("load")
        self.engine.load_shm()

    def load_transfer(self, send) -> None:
        self._write("load")
        self.engine.load_transfer(send)


def read_calls(path: str | os.PathLike) -> list[dict]:
    """The records of an `engine_calls.jsonl`, in the order they were written."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
