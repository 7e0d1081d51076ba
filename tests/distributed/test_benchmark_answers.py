"""The five benchmarks shipped with the package load whole by name and their gold answers parse
with math-verify (in the reward's timeout pool of worker processes)."""

import pytest

from cwgrpo_megatron.eval.runner import load_benchmarks
from cwgrpo_megatron.reward.pool import TimeoutPool
from cwgrpo_megatron.reward.verify import gold_parses

COUNTS = {"aime24": 30, "amc23": 40, "olympiadbench": 675, "math500": 500, "minerva": 272}


@pytest.fixture(scope="module")
def parse_pool():
    with TimeoutPool(gold_parses, workers=2, timeout_s=10.0, default=False) as pool:
        yield pool


@pytest.mark.parametrize("name", list(COUNTS))
def test_benchmark_gold_answers_parse(name, parse_pool):
    problems = load_benchmarks([name])[name]
    assert len(problems) == COUNTS[name]
    ok = parse_pool.map([(p.answer,) for p in problems])
    assert sum(ok) >= 0.99 * COUNTS[name], [
        p.answer for p, good in zip(problems, ok, strict=True) if not good
    ][:10]
