"""Dynamic sampling's rounds (`data.dynamic_sampling.StepRounds`) and its settings."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from cwgrpo_megatron.config import load_config
from cwgrpo_megatron.data.dynamic_sampling import StepRounds, reward_std
from cwgrpo_megatron.run.step_metrics import rollout_metrics


def group(position: int, *rewards: float):
    return SimpleNamespace(position=position, rewards=list(rewards))


def rounds(target=2, max_rounds=3, eps=1e-6, split=lambda n: None) -> StepRounds:
    return StepRounds(target=target, max_rounds=max_rounds, eps=eps, split_problem=split)


def fill(r: StepRounds, per_round: list[list]) -> int:
    """Run the trainer's loop over prepared rounds; how many rounds were drawn."""
    drawn = 0
    while r.want_more():
        r.add(per_round[drawn])
        drawn += 1
    return drawn


def test_reward_std_is_the_population_std():
    assert reward_std([1.0, 1.0, 1.0]) == 0.0
    assert reward_std([0.0, 1.0]) == pytest.approx(0.5)
    assert reward_std([0.0, 0.0, 0.0, 3.0]) == pytest.approx(3**0.5 * 0.75)


def test_without_dynamic_sampling_one_round_keeps_every_group():
    r = rounds(target=2, max_rounds=1, eps=None)
    dead = [group(0, 1.0, 1.0), group(1, 0.0, 0.0)]
    assert fill(r, [dead]) == 1
    assert r.batch() == dead and r.metrics() == {}


def test_rounds_go_on_until_the_step_is_full_and_surplus_goes_in_prompt_order():
    r = rounds(target=3, max_rounds=5)
    first = [group(0, 1.0, 1.0), group(1, 0.0, 1.0), group(2, 0.0, 0.0)]
    second = [group(3, 0.5, 0.5), group(4, 1.0, 0.0), group(5, 0.2, 0.0)]
    third = [group(6, 0.0, 1.0)]
    assert fill(r, [first, second, third]) == 2  # 3 groups with signal after round 2
    kept = r.batch()
    assert [g.position for g in kept] == [1, 4, 5]
    assert rollout_metrics_zero_std(kept) == 0.0
    assert r.metrics() == {
        "dynamic/rounds": 2.0,
        "dynamic/groups_generated": 6.0,
        "dynamic/groups_kept": 3.0,
        "dynamic/cap_reached": 0.0,
        "dynamic/reward_generated": pytest.approx(5.2 / 12),  # both rounds, dropped groups too
    }
    # a round that brings more than the step needs: the first in prompt order are kept
    r = rounds(target=2, max_rounds=5)
    assert fill(r, [[group(0, 0.0, 1.0), group(1, 0.0, 2.0), group(2, 0.0, 3.0)]]) == 1
    assert [g.position for g in r.batch()] == [0, 1]
    assert r.metrics()["dynamic/groups_kept"] == 2.0


def rollout_metrics_zero_std(groups) -> float:
    full = [
        SimpleNamespace(
            rewards=g.rewards,
            completions=[SimpleNamespace(token_ids=[1], finish_reason="stop")] * len(g.rewards),
            correct=[0.0] * len(g.rewards),
            texts=["x"] * len(g.rewards),
            parts={},
            details={},
        )
        for g in groups
    ]
    return rollout_metrics(full)["groups/frac_zero_std"]


def test_eps_is_a_threshold_on_the_std():
    r = rounds(target=1, max_rounds=2, eps=0.3)
    assert fill(r, [[group(0, 0.0, 0.5)], [group(1, 0.0, 0.7)]]) == 2  # std 0.25, then 0.35
    assert [g.position for g in r.batch()] == [1]


def test_a_short_step_trains_on_what_it_has_when_that_splits(caplog):
    r = rounds(target=4, max_rounds=2, split=lambda n: None)
    fill(r, [[group(0, 0.0, 1.0), group(1, 1.0, 1.0)], [group(2, 1.0, 1.0), group(3, 0.0, 1.0)]])
    with caplog.at_level(logging.WARNING, logger="cwgrpo_megatron.train"):
        kept = r.batch()
    assert [g.position for g in kept] == [0, 3]
    assert "2 rounds gave 2 of 4 groups" in caplog.text and "train.max_gen_batches" in caplog.text
    assert r.metrics()["dynamic/cap_reached"] == 1.0
    assert r.metrics()["dynamic/groups_kept"] == 2.0


def test_a_short_step_that_cannot_split_is_an_error_naming_the_settings():
    r = rounds(target=4, max_rounds=2, split=lambda n: f"{n} prompts do not split over dp=2 ranks")
    fill(r, [[group(0, 0.0, 1.0)], [group(1, 1.0, 1.0)]])
    with pytest.raises(ValueError) as err:
        r.batch()
    text = str(err.value)
    assert "2 rounds (train.max_gen_batches) of 1 prompts" in text
    assert "1 of the 4 groups" in text and "1 prompts do not split over dp=2 ranks" in text
    assert "Raise train.max_gen_batches or train.gen_prompts_per_step" in text


def test_a_task_without_any_signal_is_an_error_even_when_nothing_needs_splitting():
    r = rounds(target=2, max_rounds=3, split=lambda n: None)
    assert fill(r, [[group(0, 1.0, 1.0)]] * 3) == 3
    with pytest.raises(ValueError, match="no group has a reward signal"):
        r.batch()


def test_dynamic_sampling_settings_are_checked():
    cfg = load_config(overrides=["train.dynamic_sampling=true", "train.prompts_per_step=4"])
    assert cfg.train.prompts_per_round == 4 and cfg.train.max_gen_batches == 10
    cfg = load_config(overrides=["train.dynamic_sampling=true", "train.gen_prompts_per_step=16"])
    assert cfg.train.prompts_per_round == 16
    with pytest.raises(ValueError, match="gen_prompts_per_step=2 is below"):
        load_config(overrides=["train.dynamic_sampling=true", "train.gen_prompts_per_step=2"])
    with pytest.raises(ValueError, match="only used with dynamic sampling"):
        load_config(overrides=["train.gen_prompts_per_step=24"])
    with pytest.raises(ValueError, match="max_gen_batches"):
        load_config(overrides=["train.max_gen_batches=0"])
    with pytest.raises(ValueError, match="dynamic_sampling_eps"):
        load_config(overrides=["train.dynamic_sampling_eps=-1"])


def test_split_problem_names_what_does_not_divide():
    cfg = load_config(
        overrides=["train.prompts_per_step=8", "train.group_size=2", "train.micro_batch_size=4"]
    )
    assert cfg.split_problem(8, 2) is None
    assert cfg.split_problem(2, 1) is None
    assert cfg.split_problem(3, 2) == "3 prompts per mini-batch do not split over dp=2 ranks"
    assert "not a multiple of train.micro_batch_size=4" in cfg.split_problem(2, 2)
    two = load_config(overrides=["train.ppo_mini_batches=2", "train.total_steps=4"])
    assert two.split_problem(3, 1) == "3 prompts do not split into 2 mini-batches"
