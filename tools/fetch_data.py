"""Copy a Hugging Face dataset into a local JSONL file that the trainer and tools/evaluate.py read,
for clusters whose compute nodes cannot reach the hub (needs the `hub` extra: `datasets`).

    python tools/fetch_data.py knoveleng/open-rs --out data/open_rs.jsonl
    python tools/fetch_data.py HuggingFaceH4/MATH-500 --split test --out data/math500.jsonl

NAME is a hub id, or a local dataset folder (a dataset repository's files, or `save_to_disk`'s
output). Every row is first read as the loaders read it (schema detected, or --schema), so a
file that is written is one they accept: rows are kept whole, with all their fields. The file
is written to a temporary name beside --out and renamed, so no half-written file is left.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse(argv):
    from cwgrpo_megatron.data.names import SCHEMAS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="a Hugging Face dataset id, or a local dataset folder")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--split", default="train", help="the split to copy (default: train)")
    p.add_argument(
        "--schema", default="auto", choices=["auto", *SCHEMAS.names()], help="default: detected"
    )
    p.add_argument("--skip-bad-rows", action="store_true", help="drop rows the loaders reject")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from tqdm import tqdm

    from cwgrpo_megatron.common.files import write_atomic
    from cwgrpo_megatron.data.prompts import hub_rows, problems_from_rows

    try:
        rows = hub_rows(args.name, split=args.split)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines, skipped = [], []
    for where, row in tqdm(rows, desc="checking rows", unit="row", disable=len(rows) < 10_000):
        try:
            problems_from_rows([(where, row)], args.name, schema=args.schema)
        except ValueError as err:
            if not args.skip_bad_rows:
                print(f"error: {err}; or pass --skip-bad-rows", file=sys.stderr)
                return 2
            skipped.append(str(err))
            continue
        lines.append(json.dumps(row, ensure_ascii=False, default=str))
    if not lines:
        print(f"error: {args.name} ({args.split}) has no row the loaders accept", file=sys.stderr)
        return 2
    path = write_atomic(args.out, "".join(line + "\n" for line in lines))
    print(f"wrote {path}: {len(lines)} rows of {args.name} ({args.split}), {len(skipped)} skipped")
    for message in skipped[:5]:
        print(f"skipped {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
