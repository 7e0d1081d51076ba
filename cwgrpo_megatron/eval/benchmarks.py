"""The shipped benchmarks, registered as a plugin's would be (`eval.names.register_benchmark`);
their sources and terms: `data/SOURCES.md`."""

from pathlib import Path

from cwgrpo_megatron.eval.names import SHIPPED_BENCHMARKS, register_benchmark

SHIPPED = Path(__file__).resolve().parent / "data"

for _name in SHIPPED_BENCHMARKS:
    register_benchmark(_name, str(SHIPPED / f"{_name}.jsonl"))
