"""Rewards for math reasoning, behind a registry.

    from cwgrpo_megatron.reward import get_reward
    reward = get_reward("accuracy")
    scores = reward(completions=[...], answers=[...])    # list[float], one per completion

`get_reward(name, **options)` returns a new reward object; rewards that hold worker processes
(accuracy, cosine_length) release them with `close()` or a `with` block.

    accuracy       1 if math-verify finds the last \\boxed{} (after </think>) equal to the gold
                   answer, else 0; timeouts and parse failures score 0 and are counted
    format         1 if the completion holds exactly one "\\n</think>\\n" (Open-RS), else 0
    cosine_length  Open-RS's cosine-scaled length reward on top of accuracy, with the length in
                   tokens (`completion_lengths=`), clamped to max_len
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from cwgrpo_megatron.registry import Registry
from cwgrpo_megatron.reward.pool import TimeoutPool
from cwgrpo_megatron.reward.verify import VerifyStats, verify_one

REWARDS: Registry[type] = Registry("reward")
register_reward = REWARDS.register


def get_reward(name: str, **options):
    """A new instance of reward `name`; `options` go to its constructor."""
    return REWARDS.get(name)(**options)


def _check_lengths(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")


class Reward:
    """Base: `reward(completions=..., answers=..., **extra) -> list[float]`; `close()` frees
    worker processes (also via `with`)."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@register_reward("accuracy")
class AccuracyReward(Reward):
    """math-verify on `workers` processes, each task limited to `timeout_s` seconds."""

    def __init__(self, *, workers: int | None = None, timeout_s: float = 5.0) -> None:
        self.workers = workers or max(1, os.cpu_count() or 1)
        self.timeout_s = timeout_s
        self.stats = VerifyStats()
        self._pool: TimeoutPool | None = None

    def __call__(self, *, completions: Sequence[str], answers: Sequence[str], **_) -> list[float]:
        _check_lengths(completions, answers)
        if self._pool is None:
            self._pool = TimeoutPool(
                verify_one, workers=self.workers, timeout_s=self.timeout_s, default=None
            )
        before = (self._pool.stats.timeouts, self._pool.stats.errors)
        outcomes = self._pool.map(
            [(str(c), str(a)) for c, a in zip(completions, answers, strict=True)]
        )
        self.stats.timeouts += self._pool.stats.timeouts - before[0]
        self.stats.errors += self._pool.stats.errors - before[1]
        scores = []
        for outcome in outcomes:
            score, kind = outcome if outcome is not None else (0.0, "failed")
            self.stats.total += 1
            self.stats.correct += int(score > 0)
            if kind == "no_answer":
                self.stats.no_answer += 1
            elif kind == "parse_error":
                self.stats.parse_error += 1
            scores.append(float(score))
        return scores

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


THINK_BLOCK_END = "\n</think>\n"


@register_reward("format")
class FormatReward(Reward):
    """Open-RS's format check: the reasoning closes exactly once with "\\n</think>\\n"."""

    def __call__(self, *, completions: Sequence[str], answers: Sequence[str], **_) -> list[float]:
        _check_lengths(completions, answers)
        return [1.0 if c.count(THINK_BLOCK_END) == 1 else 0.0 for c in completions]


@register_reward("cosine_length")
class CosineLengthReward(Reward):
    """Open-RS's cosine-scaled reward: with L = min(length, max_len) tokens and
    c = cos(pi L / max_len),

        correct:  r = min_correct + (max_correct - min_correct) (1 + c) / 2   (short is best)
        wrong:    r = max_wrong   + (min_wrong - max_wrong)     (1 + c) / 2   (long is least bad)

    Lengths are clamped (the character-based original wraps around past max_len).
    """

    def __init__(
        self,
        *,
        max_len: int = 1000,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        workers: int | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.correct_range = (min_value_correct, max_value_correct)
        self.wrong_range = (max_value_wrong, min_value_wrong)
        self.accuracy = AccuracyReward(workers=workers, timeout_s=timeout_s)

    def __call__(
        self,
        *,
        completions: Sequence[str],
        answers: Sequence[str],
        completion_lengths: Sequence[int] | None = None,
        **_,
    ) -> list[float]:
        if completion_lengths is None:
            raise ValueError("cosine_length needs completion_lengths= (tokens per completion)")
        if len(completion_lengths) != len(completions):
            raise ValueError("completion_lengths must have one entry per completion")
        correct = self.accuracy(completions=completions, answers=answers)
        out = []
        for ok, length in zip(correct, completion_lengths, strict=True):
            cosine = math.cos(math.pi * min(int(length), self.max_len) / self.max_len)
            low, high = self.correct_range if ok > 0 else self.wrong_range
            out.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return out

    def close(self) -> None:
        self.accuracy.close()


class WeightedReward(Reward):
    """sum_k weight_k * reward_k, for a {name: weight} mapping."""

    def __init__(self, weights: dict[str, float], **options) -> None:
        if not weights:
            raise ValueError("weights must name at least one reward")
        self.parts = {
            name: (float(w), get_reward(name, **options.get(name, {})))
            for name, w in weights.items()
        }

    def __call__(self, **batch) -> list[float]:
        total = None
        for weight, reward in self.parts.values():
            scores = reward(**batch)
            total = (
                [weight * s for s in scores]
                if total is None
                else [t + weight * s for t, s in zip(total, scores, strict=True)]
            )
        return total

    def close(self) -> None:
        for _, reward in self.parts.values():
            reward.close()


__all__ = ["REWARDS", "Reward", "WeightedReward", "get_reward", "register_reward"]
