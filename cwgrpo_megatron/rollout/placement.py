"""Separate placement on CPU (`rollout.placement=separate`): which cores the engines get, which
the trainer keeps, and binding a process's threads to them.

The cores this process may run on (its affinity when the run starts) are split on each node:

    engine cores   the last rollout.cpu_cores, dealt out in order to the node's E engines
                   (engine i takes its i-th contiguous share; an engine of rollout.tp workers
                   splits its share again, one list per worker, for VLLM_CPU_OMP_THREADS_BIND)
    trainer cores  the others, shared by every trainer rank on the node

Linux binds threads, not processes: a process is bound by setting the affinity of each of its
threads (/proc/PID/task); threads it starts later inherit their creator's. On GPUs the
engines' devices come from `rollout.replicas.Replicas` instead, and nothing is bound here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class CoreSplit(NamedTuple):
    engine: list[int]
    """This engine's cores (empty for a rank that owns none)."""
    trainer: list[int]


def split_cores(
    allowed: Sequence[int], *, engine_cores: int, engines: int, engine: int | None, tp: int = 1
) -> CoreSplit:
    """The split for a rank that may use `allowed` cores, on a node with `engines` engines of
    `tp` workers, of which it owns number `engine` (None: none). ValueError, with the fix, when
    the trainer would keep no core or an engine worker would get none."""
    cores = sorted(allowed)
    if engine_cores >= len(cores):
        raise ValueError(
            f"rollout.cpu_cores={engine_cores} leaves the trainer none of this node's "
            f"{len(cores)} cores: lower it below {len(cores)}"
        )
    if engine_cores < engines * tp:
        raise ValueError(
            f"rollout.cpu_cores={engine_cores} gives fewer than one core to each of the node's "
            f"{engines} engines x rollout.tp={tp} workers: raise it to {engines * tp}, or lower "
            "rollout.replicas"
        )
    pool = cores[len(cores) - engine_cores :]
    mine = []
    if engine is not None:
        mine = pool[engine * engine_cores // engines : (engine + 1) * engine_cores // engines]
    return CoreSplit(engine=mine, trainer=cores[: len(cores) - engine_cores])


def omp_bind(cores: Sequence[int], workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `workers` workers on `cores`: one
    comma-separated list per worker, joined by '|' (vLLM's format)."""
    n = len(cores)
    lists = [cores[i * n // workers : (i + 1) * n // workers] for i in range(workers)]
    return "|".join(",".join(map(str, part)) for part in lists)


def bind_process(pid: int, cores: Iterable[int]) -> None:
    """Every thread of process `pid` may run on `cores` only (a thread that ends meanwhile is
    skipped)."""
    cores = set(cores)
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(tid), cores)


def process_cores(pid: int) -> set[int]:
    """The union of the cores the threads of `pid` may run on."""
    found: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            found |= os.sched_getaffinity(int(tid))
    return found
