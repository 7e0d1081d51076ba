"""Per-phase wall-clock timing of a training step: `with timer("rollout"): ...`.

A phase may be entered several times in a step (its seconds add up). On CUDA the device is
synchronised when a phase ends, so the seconds are the phase's work rather than its kernel
launches: a handful of host syncs per step, at phase boundaries only.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start
