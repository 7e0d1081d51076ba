"""Convert a Hugging Face Qwen2 / Qwen3 / Qwen3-MoE / Llama checkpoint into a Megatron dist
checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir D --out C --tp N --pp M [--dtype bfloat16]
        [--ep E --expert-tp T]

One process builds the whole model and writes a checkpoint that loads at any TP x PP (x EP,
Megatron reshards on load); --tp / --pp / --ep / --expert-tp are checked against the model and
--tp sets the vocabulary padding. Under `torchrun --nproc-per-node M*lcm(N, E*T)` each rank
converts its own shard (its experts only). The HF config, generation config and tokenizer
files are kept beside the checkpoint.
"""

import argparse
import logging
import sys

from cwgrpo_megatron.megatron.conversion import hf_to_megatron


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="folder with config.json + safetensors")
    parser.add_argument("--out", required=True, help="checkpoint folder to create")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to plan for")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to plan for")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    parser.add_argument(
        "--expert-tp", type=int, default=1, help="expert tensor-parallel size (MoE models)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="parameter dtype (default: the HF config's torch_dtype)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        out = hf_to_megatron(
            args.hf_dir,
            args.out,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            expert_tp=args.expert_tp,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
