"""Benchmark evaluation through the rollout engine: avg@n, pass@k and distinct answers per
benchmark."""

from cwgrpo_megatron.eval.metrics import pass_at_k
from cwgrpo_megatron.eval.names import (
    BENCHMARKS,
    SHIPPED_BENCHMARKS,
    Benchmark,
    register_benchmark,
)
from cwgrpo_megatron.eval.runner import benchmark_source, evaluate, load_benchmarks

__all__ = [
    "BENCHMARKS",
    "SHIPPED_BENCHMARKS",
    "Benchmark",
    "benchmark_source",
    "evaluate",
    "load_benchmarks",
    "pass_at_k",
    "register_benchmark",
]
