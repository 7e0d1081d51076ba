"""Helpers for the processes a run starts, in a module that imports nothing heavy: a free port
for a rendezvous, and what a child runs first (a child started with the `spawn` method imports
the module of the function it runs, and a module that imported Megatron or vLLM would add
seconds to its start)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys


def die_with_parent() -> None:
    """In a child process: SIGKILL when the process that started it dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing), so that a SIGKILLed trainer leaves no helper behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the request
            os._exit(1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for single-host process groups and
    rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
