"""Helpers run inside child processes, kept in a module that imports nothing heavy: a child
started with the `spawn` method imports the module of the function it runs, and a module that
imported Megatron or vLLM would add seconds to its start."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent() -> None:
    """In a child process: SIGKILL when the process that started it dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing), so that a SIGKILLed trainer leaves no helper behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the request
            os._exit(1)
