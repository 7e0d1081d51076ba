"""The groups a step trains on, gathered in generation rounds (DAPO's dynamic sampling).

A group whose G rewards are equal has zero advantage, and under CW-GRPO zero covariance c on
all its tokens: it adds nothing to the gradient but still costs its rows. With
`train.dynamic_sampling` a step generates rounds of R = `train.gen_prompts_per_step` prompts
and keeps the groups with

    std_pop(rewards of the group) >= train.dynamic_sampling_eps

until P = `train.prompts_per_step` are in hand or `train.max_gen_batches` rounds have run. The
kept groups are taken in prompt order (round, then position in the round) and cut at P, so
the batch depends on the seeds alone, never on how many replicas or ranks sampled it. Without
dynamic sampling a step is one round that keeps every group.

Every rank holds the same scored groups (`Rollouts.score` all-gathers them), so every rank
reaches the same decision, an error included, with no collective.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("cwgrpo_megatron.train")


def reward_std(rewards: Sequence[float]) -> float:
    """The population std of one group's rewards."""
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


@dataclass(kw_only=True)
class StepRounds:
    """The generation rounds of one step. Use: `while rounds.want_more(): ... rounds.add(g)`,
    then `rounds.batch()`."""

    target: int
    """P: the groups a full step trains on."""
    max_rounds: int
    """1 without dynamic sampling."""
    eps: float | None
    """The std below which a group is dropped; None keeps every group."""
    split_problem: Callable[[int], str | None]
    """Why a batch of n groups cannot be trained at this layout (`Config.split_problem`)."""
    drawn: int = 0
    """Rounds so far (the next round's index)."""
    generated: int = 0
    reward_sum: float = 0.0
    """Of every completion generated, kept or not."""
    completions: int = 0
    kept: list = field(default_factory=list)

    @property
    def dynamic(self) -> bool:
        return self.eps is not None

    def want_more(self) -> bool:
        return self.drawn < self.max_rounds and len(self.kept) < self.target

    def add(self, groups: Sequence) -> None:
        """One round's scored groups (`reward.scoring.ScoredGroup`), in prompt order."""
        self.drawn += 1
        self.generated += len(groups)
        self.reward_sum += sum(r for g in groups for r in g.rewards)
        self.completions += sum(len(g.rewards) for g in groups)
        self.kept += [g for g in groups if self.eps is None or reward_std(g.rewards) >= self.eps]

    @property
    def cap_reached(self) -> bool:
        return len(self.kept) < self.target

    def batch(self) -> list:
        """The first P kept groups. Short of P after the last round: all of them when their
        count can be trained (a warning), else ValueError naming the settings to raise."""
        if not self.cap_reached:
            return self.kept[: self.target]
        have = len(self.kept)
        problem = "no group has a reward signal" if not have else self.split_problem(have)
        if problem:
            raise ValueError(
                f"dynamic sampling: {self.drawn} rounds (train.max_gen_batches) of "
                f"{self.generated // self.drawn} prompts (train.gen_prompts_per_step) gave "
                f"{have} of the {self.target} groups with a reward std >= "
                f"train.dynamic_sampling_eps={self.eps} that a step needs, and {problem}. "
                "Raise train.max_gen_batches or train.gen_prompts_per_step, or lower "
                "train.dynamic_sampling_eps; a task whose rewards never differ cannot be learned"
            )
        log.warning(
            "dynamic sampling: %d rounds gave %d of %d groups with a reward signal; the step "
            "trains on those (raise train.max_gen_batches or train.gen_prompts_per_step)",
            self.drawn,
            have,
            self.target,
        )
        return self.kept

    def metrics(self) -> dict[str, float]:
        """dynamic/* (none without dynamic sampling). reward/mean is that of the trained
        groups, which leave out the all-right ones; dynamic/reward_generated is the mean over
        every completion the rounds generated: the policy's reward, as without dynamic
        sampling."""
        if not self.dynamic:
            return {}
        return {
            "dynamic/rounds": float(self.drawn),
            "dynamic/groups_generated": float(self.generated),
            "dynamic/groups_kept": float(min(len(self.kept), self.target)),
            "dynamic/cap_reached": float(self.cap_reached),
            "dynamic/reward_generated": self.reward_sum / max(self.completions, 1),
        }
