"""The evaluation benchmarks by name (`eval/runner.py` maps each to its file)."""

BENCHMARKS = ("aime24", "math500", "amc23", "minerva", "olympiadbench")
