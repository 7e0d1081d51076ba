"""Score rollout groups: decode each completion, run the weighted reward once over all of them.

The trainer calls this on one rank per data-parallel replica, for that replica's prompt groups
only, so every completion of the job is scored exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cwgrpo_megatron.reward import WeightedReward


@dataclass(frozen=True)
class ScoredGroup:
    """One prompt's G completions with their texts and scores (picklable: it crosses ranks)."""

    position: int
    """The prompt's position in the step's batch (its row block in the TrainBatch)."""
    problem_id: str
    answer: str
    prompt_ids: list[int]
    completions: list
    """`rollout.Completion`s: token ids, sampling log-probs, finish reason."""
    texts: list[str]
    rewards: list[float]
    """The weighted reward of each completion."""
    parts: dict[str, list[float]]
    """Each reward function's own score of each completion."""
    correct: list[float]
    """math-verify's verdict of each completion (1.0 / 0.0)."""
    details: dict[str, list[float]] = field(default_factory=dict)
    """"<reward>/<key>" of each completion: a reward's other named values and its errors
    (`reward.RewardScores.details`), logged as reward/<reward>/<key>."""


def score_groups(
    positions: Sequence[int],
    problems: Sequence,
    groups: Sequence,
    *,
    tokenizer,
    reward: WeightedReward,
) -> list[ScoredGroup]:
    """ScoredGroups of `groups` (`rollout.RolloutGroup`, G completions each) sampled for
    `problems` (`data.prompts.Problem`) at `positions`: one reward call for all completions.
    Texts keep special tokens, so format rewards see the template's own markers."""
    if not (len(positions) == len(problems) == len(groups)):
        raise ValueError("positions, problems and groups must have one entry per prompt")
    texts = [
        tokenizer.decode(c.token_ids, skip_special_tokens=False)
        for g in groups
        for c in g.completions
    ]
    if not texts:
        return []
    sizes = [len(g.completions) for g in groups]
    lengths = [len(c.token_ids) for g in groups for c in g.completions]
    each = [p for p, size in zip(problems, sizes, strict=True) for _ in range(size)]
    scores = reward.score(
        completions=texts,
        answers=[p.answer for p in each],
        completion_lengths=lengths,
        prompts=[p.problem for p in each],
        extra=[p.extra for p in each],
    )
    out, start = [], 0
    for position, problem, group, size in zip(positions, problems, groups, sizes, strict=True):
        rows = slice(start, start + size)
        out.append(
            ScoredGroup(
                position=position,
                problem_id=problem.id,
                answer=problem.answer,
                prompt_ids=list(group.prompt_ids),
                completions=list(group.completions),
                texts=texts[rows],
                rewards=scores.total[rows],
                parts={name: values[rows] for name, values in scores.parts.items()},
                details={key: values[rows] for key, values in scores.details.items()},
                correct=scores.correct[rows],
            )
        )
        start += size
    return out
