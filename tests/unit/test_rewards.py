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
        "overlong",
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


def test_overlong_penalty_is_dapos_linear_ramp_at_its_boundaries():
    """0 up to max_tokens - buffer, a linear fall to -penalty at max_tokens, -penalty past it."""
    reward = get_reward("overlong", max_tokens=100, buffer_tokens=20, penalty=0.5)
    lengths = [0, 79, 80, 81, 90, 99, 100, 101, 500]
    scores = reward(completions=["x"] * 9, answers=["1"] * 9, completion_lengths=lengths)
    expected = [0.0, 0.0, 0.0, -0.025, -0.25, -0.475, -0.5, -0.5, -0.5]
    assert scores == pytest.approx(expected)
    # as a part of a weighted sum: format's 1 (one "\n</think>\n") plus 2 x the penalty
    both = WeightedReward(
        {"format": 1.0, "overlong": 2.0},
        options={"overlong": dict(buffer_tokens=20, penalty=0.5)},
        max_tokens=100,
    )
    done = "reasoning\n</think>\nthe answer"
    assert both(completions=[done, done], answers=["1", "1"], completion_lengths=[50, 90]) == [
        1.0,
        0.5,
    ]


def test_overlong_settings_that_cannot_work_are_refused():
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.reward import build_reward

    with pytest.raises(ValueError, match=r"buffer_tokens=0 must be in \[1, max_tokens=100\]"):
        get_reward("overlong", max_tokens=100, buffer_tokens=0)
    with pytest.raises(ValueError, match="overlong penalty must be >= 0"):
        get_reward("overlong", max_tokens=100, buffer_tokens=10, penalty=-1.0)
    reward = get_reward("overlong", max_tokens=100, buffer_tokens=10)
    with pytest.raises(ValueError, match="overlong needs completion_lengths="):
        reward(completions=["x"], answers=["1"])
    too_long = load_config(
        overrides=[
            "reward.weights={accuracy: 1.0, overlong: 1.0}",
            "reward.options.overlong.buffer_tokens=600",
            "rollout.max_tokens=512",
        ]
    )
    with pytest.raises(ValueError, match=r"reward.options.overlong: buffer_tokens=600 must be in "):
        build_reward(too_long.reward, max_tokens=too_long.rollout.max_tokens)
    penalty = load_config(
        overrides=["reward.weights={repetition: 1.0}", "reward.options.repetition.max_penalty=1"]
    )
    with pytest.raises(ValueError, match=r"reward.options.repetition: max_penalty must be <= 0"):
        build_reward(penalty.reward)
    cfg = load_config(overrides=["reward.weights={format: 1.0, overlong: 1.0}"])
    with pytest.raises(ValueError, match="reward 'overlong' needs max_tokens"):
        build_reward(cfg.reward)
    with build_reward(cfg.reward, max_tokens=cfg.rollout.max_tokens) as reward:
        limit = cfg.rollout.max_tokens
        assert reward.parts["overlong"][1].max_tokens == limit


def test_each_verifier_reads_the_final_answer_it_scores():
    accuracy, integer = get_reward("accuracy"), get_reward("integer_answer")
    text = "<think>maybe \\boxed{3}</think> so \\boxed{ \\frac{1}{2} } or \\boxed{1 / 2}"
    assert accuracy.final_answer(text) == "1/2"
    assert accuracy.final_answer("<think>\\boxed{3}</think> no box after") is None
    assert integer.final_answer("it is -12, not 4") == "-12"
    assert integer.final_answer("no digits") is None
    assert get_reward("format").final_answer(text) is None  # no notion of an answer
