"""The unit tier runs in the pytest process alone: a test here that starts a process (a
subprocess, a multiprocessing worker, an engine) fails, and belongs in tests/distributed or
tests/e2e."""

import contextlib
import multiprocessing.process
import subprocess

import pytest


def _refuse(*args, **kwargs):
    raise RuntimeError(
        "a unit test runs in the pytest process alone: move a test that starts a process to "
        "tests/distributed (worker processes) or tests/e2e (commands, engines)"
    )


@pytest.fixture(scope="package", autouse=True)
def one_process():
    # matplotlib's first import on a machine builds its font cache by running `fc-list`: the
    # library setting itself up, not a test starting a process. Done here, before the guard,
    # the tests that plot pass whether or not a cache exists (MPLCONFIGDIR) and in any order.
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", _refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
        yield
