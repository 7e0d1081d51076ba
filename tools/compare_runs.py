"""Compare training runs: NAME.png (reward, held-out accuracy, entropy, response length, CW
weights, grad norm) and NAME.md (per group, mean +- std over seeds, incl. entropy at matched
reward). See cwgrpo_megatron/analysis/run_compare.py for every statistic's definition.

    python tools/compare_runs.py runs/grpo_s* runs/cw_s* --out docs/results
    python tools/compare_runs.py runs/a runs/b --label A='runs/a*' --label B='runs/b*' --out cmp
    python tools/compare_runs.py runs/compare_dynamic/* --out docs/results --name compare_dynamic

    python tools/compare_runs.py runs/compare_stats/* --out docs/results --name compare_stats \
        --label trainer='*/trainer_*' --label rollout='*/rollout_*' --pair trainer,rollout

Runs are grouped by their algo.policy_loss unless a --label NAME=GLOB rule matches the folder.
Where runs logged probe/entropy (run.probe_groups) or held-out pass@k, the table adds the
mechanism and diversity statistics (the entropy change against the covariance, the tails of
c and w~ c, pass@k and distinct answers at matched accuracy; `analysis/mechanism.py`) and
NAME_mechanism.png.
--pair A,B adds, for two groups run at the same seeds, each statistic's gap between them at
the same seed and step against its spread over seeds (the table, and NAME_pairs.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run folders (each with a metrics.jsonl)")
    parser.add_argument("--out", required=True, help="folder for NAME.png and NAME.md")
    parser.add_argument("--name", default="compare", help="the files' name (default: compare)")
    parser.add_argument(
        "--label", action="append", default=[], metavar="NAME=GLOB", help="group rule (repeatable)"
    )
    parser.add_argument("--pair", metavar="A,B", help="two groups run at the same seeds")
    parser.add_argument("--quiet", action="store_true", help="print only where the files went")
    args = parser.parse_args(argv)
    from cwgrpo_megatron.analysis.mechanism import (
        entropy_changes,
        mechanism_table,
        plot_mechanism,
        top_pass_key,
    )
    from cwgrpo_megatron.analysis.run_compare import (
        label_runs,
        markdown,
        paired_table,
        plot,
        plot_pairs,
    )
    from cwgrpo_megatron.common.files import write_atomic

    try:
        runs = label_runs(args.runs, args.label)
        table = markdown(runs)
        mechanism = any(entropy_changes(r) or top_pass_key(r) for r in runs)
        if mechanism:
            table += "\n" + mechanism_table(runs)
        if args.pair:
            a, sep, b = args.pair.partition(",")
            if not sep or not a or not b:
                raise ValueError(f"--pair {args.pair!r}: write A,B, two group labels")
            table += "\n" + paired_table(runs, a, b)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figure, text = out / f"{args.name}.png", out / f"{args.name}.md"
    write_atomic(text, table)
    plot(runs, figure)
    written = [figure]
    if mechanism:
        written.append(plot_mechanism(runs, out / f"{args.name}_mechanism.png"))
    if args.pair:
        written.append(plot_pairs(runs, a, b, out / f"{args.name}_pairs.png"))
    if not args.quiet:
        print(table)
    print(f"wrote {', '.join(map(str, written))} and {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
