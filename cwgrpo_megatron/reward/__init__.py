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
    repetition     Open-R1's n-gram repetition penalty: max_penalty x the share of repeated word
                   n-grams (`repetition.py`)
    overlong       DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then a
                   linear fall to -penalty at max_tokens (`completion_lengths=`)
    integer_answer 1 if the first integer in the completion equals the integer gold answer, else
                   0 (the synthetic tasks of `data/synthetic.py`)

Rewards that need the verdict (`needs_correct`) take it as `correct=` when the caller has it:
`WeightedReward` verifies each completion once, with its verifier (math-verify's `accuracy` by
default, or `integer_answer`), and hands the verdict to every part, so accuracy and
cosine_length together cost one verification, not two.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from cwgrpo_megatron.reward.config import RewardConfig
from cwgrpo_megatron.reward.names import REWARDS, VERIFIERS
from cwgrpo_megatron.reward.pool import TimeoutPool
from cwgrpo_megatron.reward.repetition import repeated_ngram_fraction
from cwgrpo_megatron.reward.verify import VerifyStats, verify_one

register_reward = REWARDS.register


def get_reward(name: str, **options):
    """A new instance of reward `name`; `options` go to its constructor."""
    return REWARDS.get(name)(**options)


class RewardError(RuntimeError):
    """A reward function raised: which one, and what it said."""


def _check_lengths(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")


class Reward:
    """Base: `reward(completions=..., answers=..., **extra) -> list[float]`; `close()` frees
    worker processes (also via `with`)."""

    needs_correct = False
    """The reward reads math-verify's verdict (`correct=`, 1.0 / 0.0 per completion)."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@register_reward("accuracy")
class AccuracyReward(Reward):
    """math-verify on `workers` processes, each task limited to `timeout_s` seconds; a given
    `correct=` verdict is returned as it is."""

    needs_correct = True

    def __init__(self, *, workers: int | None = None, timeout_s: float = 5.0) -> None:
        self.workers = workers or max(1, os.cpu_count() or 1)
        self.timeout_s = timeout_s
        self.stats = VerifyStats()
        self._pool: TimeoutPool | None = None

    def __call__(
        self,
        *,
        completions: Sequence[str],
        answers: Sequence[str],
        correct: Sequence[float] | None = None,
        **_,
    ) -> list[float]:
        _check_lengths(completions, answers)
        if correct is not None:
            return list(correct)
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

    needs_correct = True

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
        correct: Sequence[float] | None = None,
        **_,
    ) -> list[float]:
        if completion_lengths is None:
            raise ValueError("cosine_length needs completion_lengths= (tokens per completion)")
        if len(completion_lengths) != len(completions):
            raise ValueError("completion_lengths must have one entry per completion")
        correct = self.accuracy(completions=completions, answers=answers, correct=correct)
        out = []
        for ok, length in zip(correct, completion_lengths, strict=True):
            cosine = math.cos(math.pi * min(int(length), self.max_len) / self.max_len)
            low, high = self.correct_range if ok > 0 else self.wrong_range
            out.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return out

    def close(self) -> None:
        self.accuracy.close()


@register_reward("repetition")
class RepetitionReward(Reward):
    """Open-R1's repetition penalty: r = max_penalty x (1 - unique / total) over the word
    n-grams of the completion (lower-cased, split on white space); 0 when it has fewer than n
    words. max_penalty <= 0, so r lies in [max_penalty, 0]."""

    def __init__(self, *, ngram: int = 3, max_penalty: float = -1.0) -> None:
        if ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {ngram}")
        if max_penalty > 0:
            raise ValueError(f"max_penalty must be <= 0, got {max_penalty}")
        self.ngram, self.max_penalty = ngram, max_penalty

    def __call__(self, *, completions: Sequence[str], answers: Sequence[str], **_) -> list[float]:
        _check_lengths(completions, answers)
        fractions = [repeated_ngram_fraction(c, self.ngram) for c in completions]
        return [self.max_penalty * f if f else 0.0 for f in fractions]


@register_reward("overlong")
class OverlongReward(Reward):
    """DAPO's soft overlong punishment, with L_max = max_tokens (the completion limit), a
    buffer of L_buf tokens and a penalty factor p:

        r = 0                                  L <= L_max - L_buf
        r = p ((L_max - L_buf) - L) / L_buf    L_max - L_buf < L <= L_max   (0 down to -p)
        r = -p                                 L > L_max

    L is the completion's length in tokens (`completion_lengths=`). A completion cut at the
    limit scores -p; with train.mask_truncated it also gets no loss, so only the shaping of the
    completions that did end reaches the gradient."""

    def __init__(self, *, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> None:
        if not 1 <= buffer_tokens <= max_tokens:
            raise ValueError(
                f"the overlong buffer of {buffer_tokens} tokens must be in [1, max_tokens="
                f"{max_tokens}]"
            )
        if penalty < 0:
            raise ValueError(f"the overlong penalty must be >= 0, got {penalty}")
        self.max_tokens, self.buffer, self.penalty = max_tokens, buffer_tokens, penalty

    def __call__(
        self,
        *,
        completions: Sequence[str],
        answers: Sequence[str],
        completion_lengths: Sequence[int] | None = None,
        **_,
    ) -> list[float]:
        _check_lengths(completions, answers)
        if completion_lengths is None or len(completion_lengths) != len(completions):
            raise ValueError("overlong needs completion_lengths= (tokens per completion)")
        start = self.max_tokens - self.buffer
        return [
            -self.penalty * min(1.0, max(0, int(length) - start) / self.buffer)
            for length in completion_lengths
        ]


_FIRST_INTEGER = re.compile(r"-?\d+")


def first_integer(text: str) -> int | None:
    """The first run of digits in `text`, with a minus sign right before it; None if none."""
    match = _FIRST_INTEGER.search(text)
    return None if match is None else int(match.group())


@register_reward("integer_answer")
class IntegerAnswerReward(Reward):
    """1 if `first_integer(completion)` equals the gold answer, else 0. The rule: the first run
    of digits anywhere in the completion, with an immediately preceding minus sign; "4,821" reads
    as 4 and "4821.0" as 4821. A completion without digits scores 0 (counted as no_answer). A
    gold answer that is not an integer is an error: this reward is for integer tasks."""

    def __init__(self) -> None:
        self.stats = VerifyStats()

    def __call__(self, *, completions: Sequence[str], answers: Sequence[str], **_) -> list[float]:
        _check_lengths(completions, answers)
        scores = []
        for completion, answer in zip(completions, answers, strict=True):
            try:
                gold = int(str(answer).strip())
            except ValueError:
                raise ValueError(
                    f"integer_answer needs integer gold answers, got {answer!r}; use the "
                    "accuracy reward (math-verify) for other answers"
                ) from None
            found = first_integer(completion)
            self.stats.total += 1
            self.stats.no_answer += found is None
            scores.append(1.0 if found == gold else 0.0)
            self.stats.correct += found == gold
        return scores


@dataclass(frozen=True)
class RewardScores:
    total: list[float]
    """sum_k weight_k * reward_k per completion."""
    parts: dict[str, list[float]]
    """Each reward's own (unweighted) score per completion."""
    correct: list[float]
    """The verifier's verdict per completion (1.0 / 0.0), whether or not a reward uses it."""


class WeightedReward(Reward):
    """sum_k weight_k * reward_k, for a {name: weight} mapping. Each completion is verified at
    most once, by `verifier` (accuracy: one shared math-verify pool; or integer_answer),
    whichever parts need the verdict; accuracy and cosine_length read that verdict.

    `workers` / `timeout_s` configure the math-verify pool; `options[name]` go to reward
    `name`'s constructor.
    """

    def __init__(
        self,
        weights: dict[str, float],
        *,
        workers: int | None = None,
        timeout_s: float = 5.0,
        verifier: str = "accuracy",
        **options,
    ) -> None:
        if not weights:
            raise ValueError("weights must name at least one reward")
        if verifier not in VERIFIERS:
            raise ValueError(
                f"unknown verifier {verifier!r}; choose one of: {', '.join(VERIFIERS)}"
            )
        if verifier == "accuracy":
            self.verifier = AccuracyReward(workers=workers, timeout_s=timeout_s)
        else:
            self.verifier = get_reward(verifier)
        self.parts = {
            name: (float(w), get_reward(name, **options.get(name, {})))
            for name, w in weights.items()
        }

    @property
    def stats(self) -> VerifyStats:
        return self.verifier.stats

    def score(
        self,
        *,
        completions: Sequence[str],
        answers: Sequence[str],
        completion_lengths: Sequence[int] | None = None,
    ) -> RewardScores:
        """Every part's score, their weighted sum and the verdict (always verified: a training
        loop logs accuracy whatever the reward is made of)."""
        correct = self.verifier(completions=completions, answers=answers)
        return self._combine(completions, answers, completion_lengths, correct)

    def __call__(self, *, completions, answers, completion_lengths=None, **_) -> list[float]:
        correct = None
        if any(reward.needs_correct for _, reward in self.parts.values()):
            correct = self.verifier(completions=completions, answers=answers)
        return self._combine(completions, answers, completion_lengths, correct).total

    def _combine(self, completions, answers, completion_lengths, correct) -> RewardScores:
        batch = dict(
            completions=completions,
            answers=answers,
            completion_lengths=completion_lengths,
            correct=correct,
        )
        parts = {}
        for name, (_, reward) in self.parts.items():
            try:
                parts[name] = reward(**batch)
            except Exception as err:  # user code: name it, keep its traceback as the cause
                raise RewardError(f"reward {name!r} failed: {type(err).__name__}: {err}") from err
        total = [0.0] * len(completions)
        for name, (weight, _) in self.parts.items():
            total = [t + weight * s for t, s in zip(total, parts[name], strict=True)]
        return RewardScores(total=total, parts=parts, correct=list(correct or []))

    def close(self) -> None:
        self.verifier.close()
        for _, reward in self.parts.values():
            reward.close()


def build_reward(
    cfg: RewardConfig, *, workers: int | None = None, max_tokens: int | None = None
) -> WeightedReward:
    """The WeightedReward that `cfg` (a run's `reward` settings) describes; it holds worker
    processes: close it. `workers` replaces reward.workers = 0 (one per core) where several
    ranks share a node; `max_tokens` is rollout.max_tokens (the overlong reward's limit)."""
    if "overlong" in cfg.weights and max_tokens is None:
        raise ValueError("the overlong reward needs the completion limit: pass max_tokens")
    return WeightedReward(
        dict(cfg.weights),
        workers=cfg.workers or workers,
        timeout_s=cfg.timeout_s,
        verifier=cfg.verifier,
        cosine_length={"max_len": cfg.cosine_max_len},
        repetition={"ngram": cfg.repetition_ngram, "max_penalty": cfg.repetition_max_penalty},
        overlong={
            "max_tokens": max_tokens,
            "buffer_tokens": cfg.overlong_buffer_tokens,
            "penalty": cfg.overlong_penalty,
        },
    )


__all__ = [
    "REWARDS",
    "Reward",
    "RewardError",
    "RewardScores",
    "VERIFIERS",
    "WeightedReward",
    "build_reward",
    "get_reward",
    "register_reward",
]
