"""A run's prompts: sources -> problems -> chat prompts -> token ids, filtered by length, with a
seeded held-out split.

    rows of every data.train_files source  (malformed rows: an error naming file:line, or
                                            skipped and counted with data.skip_bad_rows)
      -> prompt text (PromptFormat) -> token ids
      -> drop prompts longer than data.max_prompt_tokens (counted)
      -> a seeded permutation: its first data.heldout_size prompts are held out, the rest train

Every rank builds the same sets from the same files (deterministic, no communication).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from cwgrpo_megatron.data.prompts import Problem, PromptFormat, load_problems

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSet:
    problems: list[Problem]
    token_ids: list[list[int]]
    """Prompt token ids of each problem, same order."""

    def __len__(self) -> int:
        return len(self.problems)


@dataclass
class DataReport:
    rows: int = 0
    skipped_rows: int = 0
    too_long: int = 0
    train: int = 0
    heldout: int = 0
    first_errors: list[str] = field(default_factory=list)


def build_prompt_sets(
    data_cfg, tokenizer, prompt_format: PromptFormat
) -> tuple[PromptSet, PromptSet, DataReport]:
    """(train, heldout, report) for a `config.DataConfig`; ValueError when nothing is left."""
    if not data_cfg.train_files:
        raise ValueError("data.train_files is empty: name at least one prompt file")
    report = DataReport()
    problems: list[Problem] = []
    for source in data_cfg.train_files:
        found, stats = load_problems(
            source,
            schema=data_cfg.schema,
            split=data_cfg.split,
            skip_bad_rows=data_cfg.skip_bad_rows,
        )
        problems += found
        report.rows += stats.rows
        report.skipped_rows += stats.skipped
        report.first_errors += stats.first_errors
    if report.skipped_rows:
        log.warning(
            "skipped %d malformed rows of %d, e.g. %s",
            report.skipped_rows,
            report.rows,
            "; ".join(report.first_errors[:3]),
        )
    if not problems:
        raise ValueError(f"data.train_files {data_cfg.train_files} hold no usable rows")
    ids = prompt_format.token_ids([p.problem for p in problems], tokenizer)
    limit = data_cfg.max_prompt_tokens
    kept = [i for i, x in enumerate(ids) if len(x) <= limit]
    report.too_long = len(ids) - len(kept)
    if not kept:
        raise ValueError(
            f"all {len(ids)} prompts are longer than data.max_prompt_tokens={limit} tokens "
            f"(the shortest has {min(len(x) for x in ids)}): raise data.max_prompt_tokens, or "
            "pick a shorter chat template (model.chat_template)"
        )
    if report.too_long:
        log.warning("dropped %d of %d prompts over %d tokens", report.too_long, len(ids), limit)
    if data_cfg.heldout_size >= len(kept):
        raise ValueError(
            f"data.heldout_size={data_cfg.heldout_size} leaves no training prompts of the "
            f"{len(kept)} that fit: lower it"
        )
    gen = torch.Generator().manual_seed(data_cfg.seed)
    order = [kept[i] for i in torch.randperm(len(kept), generator=gen).tolist()]
    held, train = sorted(order[: data_cfg.heldout_size]), sorted(order[data_cfg.heldout_size :])
    report.train, report.heldout = len(train), len(held)

    def subset(indices: list[int]) -> PromptSet:
        return PromptSet([problems[i] for i in indices], [ids[i] for i in indices])

    return subset(train), subset(held), report
