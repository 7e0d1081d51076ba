"""The values every metric took in a few runs: the table of the metrics guide (docs/metrics.md).

    python tools/metric_ranges.py                            # print it for the shipped runs
    python tools/metric_ranges.py --check docs/metrics.md    # does the guide hold it?
    python tools/metric_ranges.py --write docs/metrics.md    # refresh the guide's table
    python tools/metric_ranges.py --runs RUN_DIR ...         # other runs' table (print only)

One row per metric of the runs' metrics.jsonl, one column per run: the value at the first step
that logged it -> at the last, and [min, max] over those steps. The shipped runs are `make demo`
with CW-GRPO and with GRPO (`algo.policy_loss=grpo`), copied to docs/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = "tools/metric_ranges.py"
SUFFIX = ".metrics.jsonl"
SHIPPED = (
    ROOT / "docs" / "results" / f"demo_cw_grpo{SUFFIX}",
    ROOT / "docs" / "results" / f"demo_grpo{SUFFIX}",
)


def metrics_file(path: Path) -> Path:
    """A run folder's metrics.jsonl, or the file itself."""
    return path / "metrics.jsonl" if path.is_dir() else path


def label(path: Path) -> str:
    """docs/results/demo_grpo.metrics.jsonl -> demo_grpo; runs/x/metrics.jsonl -> x."""
    if path.name.endswith(SUFFIX):
        return path.name[: -len(SUFFIX)]
    return path.parent.name


def read_steps(path: Path) -> list[dict]:
    """The lines of a metrics.jsonl; ValueError naming the file and line when one is not JSON."""
    steps = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                steps.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not a JSON line ({err.msg})") from err
    if not steps:
        raise ValueError(f"{path} holds no step")
    return steps


def fmt(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.3g}"


def cell(values: list[float]) -> str:
    """'first -> last [min, max]' of one metric in one run; '-' when it never logged."""
    if not values:
        return "-"
    if len(set(values)) == 1:
        return fmt(values[0])
    return f"{fmt(values[0])} -> {fmt(values[-1])} [{fmt(min(values))}, {fmt(max(values))}]"


def table(paths: list[Path]) -> str:
    """The markdown table of every metric of the runs at `paths`, sorted by name."""
    runs = {label(p): read_steps(p) for p in paths}
    names = sorted({k for steps in runs.values() for s in steps for k in s if k != "step"})
    head = ["metric", *(f"`{name}`" for name in runs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells = [cell([s[name] for s in steps if name in s]) for steps in runs.values()]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    spans = ", ".join(f"`{name}` {s[0]['step']}-{s[-1]['step']}" for name, s in runs.items())
    return f"Steps: {spans}.\n\n" + "\n".join(lines)


def main(argv=None) -> int:
    from cwgrpo_megatron.common import generated_docs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", type=Path, help="run folders or metrics.jsonl files")
    generated_docs.add_doc_flags(parser)
    args = parser.parse_args(argv)
    if args.runs and (args.write or args.check):
        parser.error("--write and --check use the shipped runs: leave out --runs")
    paths = [metrics_file(p) for p in args.runs] if args.runs else list(SHIPPED)
    try:
        block = table(paths)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return generated_docs.print_write_or_check(args, block, tool=TOOL)


if __name__ == "__main__":
    sys.exit(main())
