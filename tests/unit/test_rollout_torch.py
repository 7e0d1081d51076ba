"""The plain-torch rollout backend against the shared backend checks, plus its pure parts."""

import pytest
import torch

from cwgrpo_megatron.checks.tiny import save_tiny_qwen2
from cwgrpo_megatron.rollout import ROLLOUT_BACKENDS, get_engine
from cwgrpo_megatron.rollout.base import checked_weights
from cwgrpo_megatron.rollout.torch_engine import filter_logits
from tests.rollout_checks import CHECKS, MAX_MODEL_LEN


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "hf"))


@pytest.fixture(scope="module")
def engine(hf_dir):
    return get_engine("torch")(hf_dir, max_model_len=MAX_MODEL_LEN, seed=0)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_torch_backend(check, engine, hf_dir):
    CHECKS[check](engine, hf_dir)


def test_registry_lists_backends():
    assert ROLLOUT_BACKENDS.names() == ["torch", "vllm"]
    with pytest.raises(ValueError, match="choose one of: torch, vllm"):
        get_engine("sglang")


def test_filter_logits_top_k_top_p():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(z, top_k=2, top_p=1.0)[0, 2:]).all()
    kept = torch.isfinite(filter_logits(z, top_k=0, top_p=0.8))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8: the third is not needed
    kept = torch.isfinite(filter_logits(z, top_k=0, top_p=0.81))[0].tolist()
    assert kept == [True, True, True, False]
    assert torch.isfinite(filter_logits(z, top_k=0, top_p=0.01))[0].tolist() == [True] + [False] * 3


def test_checked_weights_passes_a_complete_update_through():
    shapes = {"a": (2,), "b": (1, 3)}
    weights = [("b", torch.zeros(1, 3)), ("a", torch.ones(2))]
    assert [n for n, _ in checked_weights(iter(weights), shapes)] == ["b", "a"]
    with pytest.raises(ValueError, match="sends a twice"):
        list(checked_weights(iter(weights + [("a", torch.ones(2))]), shapes))


def test_rollout_config_builds_the_engine_and_sampling(hf_dir):
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.rollout import build_engine, sampling_config

    cfg = load_config(
        overrides=[
            "rollout.backend=torch",
            "rollout.top_p=0.9",
            "rollout.max_tokens=8",
            "rollout.max_model_len=64",
            "data.max_prompt_tokens=56",
            "train.temperature=0.6",
        ]
    )
    sampling = sampling_config(cfg.rollout, temperature=cfg.train.temperature, seed=3)
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.6, 0.9, 8)
    engine = build_engine(cfg.rollout, hf_dir, dtype=cfg.engine_dtype, seed=cfg.train.seed)
    assert engine.max_model_len == 64 and len(engine.generate([[1, 2]], 2, sampling)) == 1
    for bad, message in (
        ("rollout.backend=sglang", "choose one of: torch, vllm"),
        ("rollout.max_tokens=5000", "leaves no room"),
        ("rollout.long_prompt=drop", "choose one of"),
        ("rollout.top_p=0", "must be in"),
        ("rollout.colour=red", "unknown"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(overrides=[bad])
