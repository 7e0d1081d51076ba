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


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: tests live in one of tests/{{{','.join(TIERS)}}}"
            )
        item.add_marker(TIERS[folder])
        if _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _uses_a_module_fixture(item) -> bool:
    """Whether the test needs a module-scoped fixture (a reference run, a gloo world, a tiny
    model). `make test` runs xdist with --dist loadgroup: such a module's tests form one group,
    run one after another on one worker, so that the fixture is built once. Scheduled test by
    test, a worker that switched modules in between would tear it down and build it again
    (three 30 s reference runs where one does)."""
    definitions = item._fixtureinfo.name2fixturedefs.values()  # pytest has no public accessor
    return any(defs[-1].scope == "module" for defs in definitions)


def pytest_sessionfinish(session, exitstatus):
    import sys

    harness = sys.modules.get("tests.distributed.harness")
    if harness is not None:
        harness.close_pools()
