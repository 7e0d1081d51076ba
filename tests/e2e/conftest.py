from pathlib import Path

import pytest

from tests.once import build_once


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A tiny random Qwen2 whose completions end at varied lengths (`save_tiny_qwen2`), one
    for the session (`tests/once.py`)."""
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    return build_once(tmp_path_factory, "tiny", lambda d: save_tiny_qwen2(d / "hf", end_tokens=32))
