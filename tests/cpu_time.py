"""Where the suite's CPU goes: a pytest plugin that appends, per test, its wall seconds and the
CPU seconds (user + system) of the pytest process and of every process below it.

    python -m pytest -n 2 -p tests.cpu_time      # writes cpu_time.<worker>.tsv in the cwd
    CWGRPO_TEST_CPU_LOG=DIR python -m pytest ... # or in DIR

On 2 cores the suite's wall time cannot drop below its CPU seconds / 2, however its tests are
scheduled; this measures that floor. A test's CPU covers its fixtures' set-up (the first test
of a module pays for a module fixture), the pool workers and the forkserver of
`tests/distributed/harness.py`, launched commands and their engines. Processes that left the
tree (a SIGKILLed trainer's orphans, re-parented to init) are not counted.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import psutil
import pytest


def _cpu_seconds() -> float:
    """This process, its reaped descendants, and every live descendant (with the children it
    has reaped), in CPU seconds."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # it ended in between: its parent's children usage has it
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    cpu, wall = _cpu_seconds() - cpu, time.monotonic() - wall
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    folder = Path(os.environ.get("CWGRPO_TEST_CPU_LOG", "."))
    with open(folder / f"cpu_time.{worker}.tsv", "a") as f:
        f.write(f"{item.nodeid}\t{wall:.1f}\t{cpu:.1f}\n")
