from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny random Qwen2 whose completions end at varied lengths (`save_tiny_qwen2`)."""
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "hf", end_tokens=32)
