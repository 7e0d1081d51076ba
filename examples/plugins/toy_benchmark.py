"""A benchmark from a JSONL file, scored by a reward of the package (or of a plugin).

    python tools/evaluate.py --plugin examples/plugins/toy_benchmark.py \\
        --model-dir RUN_OR_HF_DIR --benchmarks toy_sums
    eval.benchmarks: [toy_sums]           (with run.plugins naming this file)

toy_sums.jsonl beside this file holds {"question", "result"} rows: a schema of its own maps
them to problems, and integer_answer (the first integer of the completion) scores them.
"""

from pathlib import Path

from cwgrpo_megatron.data.names import SCHEMAS
from cwgrpo_megatron.data.prompts import Problem
from cwgrpo_megatron.eval import register_benchmark


@SCHEMAS.register("toy_sums")
def toy_sums(row: dict, index: int) -> Problem:
    return Problem(id=str(row.get("id", index)), problem=row["question"], answer=str(row["result"]))


register_benchmark(
    "toy_sums",
    str(Path(__file__).with_name("toy_sums.jsonl")),
    schema="toy_sums",
    scorer="integer_answer",
)
