"""Rewards computed in the calling process: format, repetition, weighted sums and the registry.
math-verify's accuracy reward, in its timeout pool, is in tests/distributed/test_rewards.py."""

import math

import pytest

from cwgrpo_megatron.reward import REWARDS, WeightedReward, get_reward


def test_format_reward():
    fmt = get_reward("format")
    completions = [
        "<think>\nreasoning\n</think>\nanswer",
        "reasoning\n</think>\nanswer",  # R1-Distill prompts end with <think>\n
        "<think>\nno close</think>answer",
        "<think>\na\n</think>\nb\n</think>\nc",
    ]
    assert fmt(completions=completions, answers=[""] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_weighted_combination_and_registry():
    combo = WeightedReward({"format": 0.5})
    assert combo(completions=["x\n</think>\ny", "x"], answers=["", ""]) == [0.5, 0.0]
    assert REWARDS.names() == [
        "accuracy",
        "cosine_length",
        "format",
        "integer_answer",
        "repetition",
    ]
    with pytest.raises(ValueError, match="unknown reward 'length'; choose one of: accuracy"):
        get_reward("length")


def test_repetition_reward_is_open_r1_penalty():
    reward = get_reward("repetition", ngram=2, max_penalty=-2.0)
    completions = [
        "a b c d",  # 3 distinct bigrams
        "a b a b a b",  # 5 bigrams, 2 distinct: 1 - 2/5
        "one",  # fewer words than n
        "A b a B",  # lower-cased: (a b) (b a) (a b) -> 1 - 2/3
    ]
    scores = reward(completions=completions, answers=[""] * 4)
    assert scores == pytest.approx([0.0, -2.0 * 0.6, 0.0, -2.0 / 3])
    assert all(math.copysign(1.0, s) > 0 for s in scores if s == 0)  # no -0.0 in the logs
    with pytest.raises(ValueError, match="max_penalty must be <= 0"):
        get_reward("repetition", max_penalty=0.5)
