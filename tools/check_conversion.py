"""Compare an HF model with a Megatron checkpoint on fixed token sequences.

    python tools/check_conversion.py --hf-dir D --ckpt C [--tol 1e-4]

Prints max |delta logits| and max |delta log-prob|; exits 1 when either exceeds --tol.
"""

import argparse
import json
import sys

from cwgrpo_megatron.megatron.conversion import compare_with_hf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="tolerance on both maxima (fp32; use ~5e-2 for bf16 checkpoints)",
    )
    args = parser.parse_args(argv)
    try:
        result = compare_with_hf(args.hf_dir, args.ckpt)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    worst = max(result.values())
    if worst > args.tol:
        print(f"FAIL: {worst:.3g} > tolerance {args.tol:g}", file=sys.stderr)
        return 1
    print(f"OK: {worst:.3g} <= tolerance {args.tol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
