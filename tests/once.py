"""Expensive fixtures built once per test session, whichever xdist worker asks first.

`make test` runs two xdist workers that take tests one by one (worksteal). A module-scoped
fixture is then built by each worker that runs one of the module's tests, and again whenever
a worker comes back to the module after another one: `test_train.py`'s 30 s reference run was
built three times in one suite. `build_once` builds it a single time, in the session's shared
temp folder, under a file lock; a worker that asks while it is being built waits for it.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

T = TypeVar("T")


def session_root(tmp_path_factory) -> Path:
    """The session's temp folder, shared by every xdist worker (each has its own below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)`'s value, computed once per session: the first caller builds into
    `<session temp>/once-<name>/` and pickles the value; later callers, in any worker, read
    it. A build that raises leaves nothing behind, so the next caller tries again (and fails
    alike)."""
    root = session_root(tmp_path_factory)
    folder, value = root / f"once-{name}", root / f"once-{name}.pickle"
    with FileLock(str(root / f"once-{name}.lock")):
        if value.exists():
            return pickle.loads(value.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        result = build(folder)
        partial = value.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(result))
        partial.rename(value)
        return result
