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
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cwgrpo_megatron.common.settings import signature_options
from cwgrpo_megatron.data.latex import last_boxed
from cwgrpo_megatron.reward.config import ON_ERROR, RewardConfig
from cwgrpo_megatron.reward.names import REWARDS, VERIFIERS
from cwgrpo_megatron.reward.pool import TimedCalls, TimeoutPool
from cwgrpo_megatron.reward.repetition import repeated_ngram_fraction
from cwgrpo_megatron.reward.verify import VerifyStats, answer_region, verify_one

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

    def final_answer(self, completion: str) -> str | None:
        """The answer this reward reads from `completion`, as text (evaluation counts the
        distinct ones per problem); None when it reads none, or has no notion of one."""
        return None

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

    def final_answer(self, completion: str) -> str | None:
        """The last \\boxed{} after </think>, whitespace removed (two forms of one value, "1/2"
        and "\\frac12", count as two answers)."""
        boxed = last_boxed(answer_region(completion))
        return None if boxed is None else "".join(boxed.split())

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

    def __init__(self, *, max_tokens: int, buffer_tokens: int = 512, penalty: float = 1.0) -> None:
        if not 1 <= buffer_tokens <= max_tokens:
            raise ValueError(
                f"buffer_tokens={buffer_tokens} must be in [1, max_tokens={max_tokens}] (the "
                "completion limit, rollout.max_tokens): the penalty would start before the "
                "first token; lower it"
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

    def final_answer(self, completion: str) -> str | None:
        found = first_integer(completion)
        return None if found is None else str(found)

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
    details: dict[str, list[float]] = field(default_factory=dict)
    """"<reward>/<key>": the other values of a reward that returns a dict per completion, and
    "<reward>/errors" (1.0 for each completion it failed to score, with reward.on_error=zero)."""


def make_reward(name: str, options: Mapping[str, Any] | None = None, **provided):
    """Reward `name` built from its `options` (reward.options.<name>) and, of `provided` (the
    run's workers, timeout_s, max_tokens: `config.PROVIDED`), what its signature names; the
    one path for built-in and plugin rewards. A bad option is a ValueError naming the key."""
    factory = REWARDS.get(name)
    accepted, required = signature_options(factory) or (None, [])
    lacking = [k for k in required if k in provided and provided[k] is None]
    if lacking:
        raise ValueError(f"reward {name!r} needs {', '.join(lacking)}: pass it to build it")
    taken = {
        k: v for k, v in provided.items() if v is not None and (accepted is None or k in accepted)
    }
    try:
        return factory(**dict(options or {}), **taken)
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward.options.{name}: {err}") from err


class WeightedReward(Reward):
    """sum_k weight_k * reward_k, for a {name: weight} mapping. Each completion is verified at
    most once, by `verifier` (accuracy: one shared math-verify pool; or integer_answer),
    whichever parts need the verdict; accuracy and cosine_length read that verdict.

    `options[name]` go to reward `name`'s constructor, and so do `workers`, `timeout_s` (the
    math-verify pool's) and `max_tokens` (rollout.max_tokens) where its signature names them
    (`make_reward`). A part that raises, or with `call_timeout_s` overruns it, stops the
    scoring with a `RewardError` naming it, or with `on_error="zero"` scores its completions 0
    and counts them (`details`).
    """

    def __init__(
        self,
        weights: dict[str, float],
        *,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        workers: int | None = None,
        timeout_s: float = 5.0,
        max_tokens: int | None = None,
        verifier: str = "accuracy",
        on_error: str = "raise",
        call_timeout_s: float | None = None,
    ) -> None:
        if not weights:
            raise ValueError("weights must name at least one reward")
        if verifier not in VERIFIERS:
            raise ValueError(
                f"unknown verifier {verifier!r}; choose one of: {', '.join(VERIFIERS)}"
            )
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}; choose one of: {', '.join(ON_ERROR)}")
        if verifier == "accuracy":
            self.verifier = AccuracyReward(workers=workers, timeout_s=timeout_s)
        else:
            self.verifier = get_reward(verifier)
        self.on_error = on_error
        self.call_timeout_s = call_timeout_s
        self._timed: dict[str, TimedCalls] = {}
        options = options or {}
        provided = dict(workers=workers, timeout_s=timeout_s, max_tokens=max_tokens)
        self.parts = {}
        try:
            for name, w in weights.items():
                self.parts[name] = (float(w), make_reward(name, options.get(name), **provided))
        except BaseException:
            self.close()
            raise

    @property
    def stats(self) -> VerifyStats:
        return self.verifier.stats

    def score(
        self,
        *,
        completions: Sequence[str],
        answers: Sequence[str],
        completion_lengths: Sequence[int] | None = None,
        prompts: Sequence[str] | None = None,
        extra: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardScores:
        """Every part's score, their weighted sum and the verdict (always verified: a training
        loop logs accuracy whatever the reward is made of). `prompts` and `extra` (the problem
        statement and the problem's whole row, one per completion) reach every part."""
        correct = self.verifier(completions=completions, answers=answers)
        batch = dict(completions=completions, answers=answers)
        batch.update(completion_lengths=completion_lengths, prompts=prompts, extra=extra)
        return self._combine(batch, correct)

    def __call__(
        self, *, completions, answers, completion_lengths=None, prompts=None, extra=None, **_
    ) -> list[float]:
        """The weighted sum alone; the verdict only when a part reads it."""
        correct = None
        if any(reward.needs_correct for _, reward in self.parts.values()):
            correct = self.verifier(completions=completions, answers=answers)
        batch = dict(completions=completions, answers=answers)
        batch.update(completion_lengths=completion_lengths, prompts=prompts, extra=extra)
        return self._combine(batch, correct).total

    def _combine(self, batch: dict, correct) -> RewardScores:
        count = len(batch["completions"])
        parts, details = {}, {}
        for name, (_, reward) in self.parts.items():
            try:
                parts[name], named = _scores(name, self._call(name, reward, batch, correct), count)
            except Exception as err:  # user code: name it, keep its traceback as the cause
                if self.on_error == "raise":
                    raise RewardError(
                        f"reward {name!r} failed: {type(err).__name__}: {err} (reward.on_error="
                        "zero scores such completions 0 and counts them instead)"
                    ) from err
                parts[name], named = [0.0] * count, {"errors": [1.0] * count}
            details.update({f"{name}/{key}": values for key, values in named.items()})
        total = [0.0] * count
        for name, (weight, _) in self.parts.items():
            total = [t + weight * s for t, s in zip(total, parts[name], strict=True)]
        return RewardScores(total=total, parts=parts, correct=list(correct or []), details=details)

    def _call(self, name: str, reward, batch: dict, correct):
        if self.call_timeout_s is None:
            return reward(**batch, correct=correct)
        timed = self._timed.setdefault(name, TimedCalls(self.call_timeout_s))
        return timed(reward, **batch, correct=correct)

    def close(self) -> None:
        self.verifier.close()
        for _, reward in getattr(self, "parts", {}).values():
            reward.close()


def _scores(name: str, out, count: int) -> tuple[list[float], dict[str, list[float]]]:
    """A reward's return value as (its score per completion, its other named values): a list
    of `count` floats, or of `count` dicts of floats whose first key is the score."""
    if not isinstance(out, Sequence) or isinstance(out, str) or len(out) != count:
        got = f"{len(out)} values" if isinstance(out, Sequence) else type(out).__name__
        raise ValueError(f"reward {name!r} returned {got} for {count} completions")
    if not out or not isinstance(out[0], Mapping):
        return [_number(name, x) for x in out], {}
    keys = list(out[0])
    if not keys:
        raise ValueError(f"reward {name!r} returned an empty dict: its first key is the score")
    for row in out:
        if not isinstance(row, Mapping) or list(row) != keys:
            raise ValueError(f"reward {name!r}: every completion's dict must have keys {keys}")
    return [_number(name, row[keys[0]]) for row in out], {
        key: [_number(name, row[key]) for row in out] for key in keys[1:]
    }


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"reward {name!r} returned {value!r}: scores must be finite numbers")
    return float(value)


def build_reward(
    cfg: RewardConfig, *, workers: int | None = None, max_tokens: int | None = None
) -> WeightedReward:
    """The WeightedReward that `cfg` (a run's `reward` settings) describes; it holds worker
    processes: close it. `workers` replaces reward.workers = 0 (one per core) where several
    ranks share a node; `max_tokens` is rollout.max_tokens (the overlong reward's limit)."""
    return WeightedReward(
        dict(cfg.weights),
        options=cfg.options,
        workers=cfg.workers or workers,
        timeout_s=cfg.timeout_s,
        max_tokens=max_tokens,
        verifier=cfg.verifier,
        on_error=cfg.on_error,
        call_timeout_s=cfg.call_timeout_s,
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
    "make_reward",
    "register_reward",
]
