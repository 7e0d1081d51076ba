"""The pass@k estimator, and the benchmark names that settings accept each having a file.
Scoring is tested in tests/distributed/test_evaluate_scoring.py and
tools/evaluate.py in tests/e2e/test_evaluate_cli.py."""

import pytest

from cwgrpo_megatron.eval.metrics import pass_at_k
from cwgrpo_megatron.eval.names import BENCHMARKS
from cwgrpo_megatron.eval.runner import BENCHMARK_FILES


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # avg@n
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_every_benchmark_name_has_a_file_and_no_file_lacks_a_name():
    # eval.benchmarks is checked against the names; the runner maps each name to its file
    assert tuple(BENCHMARK_FILES) == BENCHMARKS
