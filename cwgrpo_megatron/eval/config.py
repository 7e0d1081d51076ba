"""Benchmark evaluation's settings."""

from dataclasses import dataclass, field

from cwgrpo_megatron.common.settings import check_range
from cwgrpo_megatron.eval.names import check_entry


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """Benchmark evaluation through the rollout engine, every run.eval_every steps."""

    benchmarks: list[str] = field(default_factory=list)
    """Names: aime24, math500, amc23, minerva, olympiadbench (shipped with the package, in
    `cwgrpo_megatron/eval/data/`), heldout (data.heldout_size prompts of the training data); or
    a .jsonl / .parquet file, a synthetic task (synthetic:TASK?n=N&seed=S) or a Hugging Face
    dataset id, reported under its file's stem, the task's name or the id's last part."""
    limit: int | None = None
    """First N problems of each benchmark; None: all."""
    n: int = 1
    """Samples per problem (avg@n; pass@k for k = 2, 4, 8, 16 below n, and n)."""
    temperature: float = 0.6
    """Sampling temperature (the paper's 0.6)."""
    top_p: float = 0.95
    """Nucleus sampling (the paper's 0.95)."""
    max_tokens: int | None = None
    """Max new tokens; None means rollout.max_tokens. Prompts without room are skipped."""
    data_dir: str | None = None
    """A folder of NAME.jsonl files to read the named benchmarks from instead of the copies
    shipped with the package; None: the shipped copies."""
    split: str = "test"
    """The split of a Hugging Face dataset id in eval.benchmarks (needs the `hub` extra)."""
    seed: int = 0
    """Problem p of a benchmark is sampled with seed + p n, whichever engine samples it."""

    def __post_init__(self) -> None:
        for name in self.benchmarks:
            check_entry("eval.benchmarks", name, extra=("heldout",))
        if self.limit is not None:
            check_range("eval.limit", self.limit, low=1)
        check_range("eval.n", self.n, low=1)
        if self.temperature <= 0:
            raise ValueError(f"eval.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens is not None:
            check_range("eval.max_tokens", self.max_tokens, low=1)
