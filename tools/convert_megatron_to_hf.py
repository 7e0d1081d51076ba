"""Convert a Megatron dist checkpoint (saved at any TP x PP) into Hugging Face safetensors.

    python tools/convert_megatron_to_hf.py --ckpt C --out D

C is a checkpoint written by tools/convert_hf_to_megatron.py, a run's training checkpoint
(`runs/R/checkpoints/step_N`, or its `model/` folder; the policy is written, the optimizer
state is not read), or a run folder (`runs/R`: its newest checkpoint).

Writes sharded safetensors with model.safetensors.index.json plus the config and tokenizer
files; the result loads with transformers.AutoModelForCausalLM.from_pretrained.
"""

import argparse
import sys

from cwgrpo_megatron.megatron.conversion import find_checkpoint, megatron_to_hf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ckpt",
        required=True,
        help="a converted checkpoint, a run's checkpoints/step_N, or a run folder (its newest)",
    )
    parser.add_argument("--out", required=True, help="HF folder to create")
    parser.add_argument(
        "--max-shard-gb",
        type=float,
        default=None,
        help="safetensors shard size (default: 2, or an eighth of the model if less)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    try:
        ckpt = find_checkpoint(args.ckpt)
        print(f"converting {ckpt} ...", flush=True)
        out = megatron_to_hf(
            ckpt,
            args.out,
            max_shard_bytes=None if args.max_shard_gb is None else int(args.max_shard_gb * 2**30),
            overwrite=args.overwrite,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
