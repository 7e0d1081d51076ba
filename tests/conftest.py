import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# CI runs the same hypothesis examples every time (a failure there is reproducible); local runs
# draw new ones, and `--hypothesis-seed=N` replays a seed.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Each test's tier is its folder (pytest.ini describes them; docs/testing.md says when to run each).
TIERS = {"unit": "unit", "distributed": "dist", "e2e": "e2e", "bench": "bench"}
TESTS = Path(__file__).resolve().parent


def pytest_addoption(parser):
    parser.addoption(
        "--reverse",
        action="store_true",
        help="run the collected tests in reverse order: a test that passes only after another "
        "one (a cache it warmed, state it left) fails here",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()
    for item in items:
        folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: tests live in one of tests/{{{','.join(TIERS)}}}"
            )
        item.add_marker(TIERS[folder])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    import sys

    harness = sys.modules.get("tests.distributed.harness")
    if harness is not None:
        harness.close_pools()
