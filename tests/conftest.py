import os

import pytest
import torch
from hypothesis import settings

# CI runs the same hypothesis examples every time (a failure there is reproducible); local runs
# draw new ones, and `--hypothesis-seed=N` replays a seed.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
