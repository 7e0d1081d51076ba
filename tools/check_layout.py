"""Prove a parallel layout against TP1: run real CW-GRPO train steps and write the results.

    torchrun --nproc-per-node TP*PP*DP tools/check_layout.py --tp 2 --pp 1 \\
        --micro-batches 1 --global-batch 24 --steps 2 --out result.json [--hf-dir D] \\
        [algo.policy_loss=grpo ...]

Runs --steps optimizer steps of the real train step (cw_grpo, global scope, SGD unless
overridden) on a fixed seeded synthetic batch of prompts, responses and rewards that does not
depend on the layout, then writes JSON with `loss` and `grad_norm` (one per step),
`param_checksum` (float64 sum of all parameters after the last step, each counted once across
ranks) and `layout`. With --mini-batches M each rollout batch gives M optimizer steps, the
later ones on fresh forward-only log-probs. Without --hf-dir a built-in tiny random Qwen2 is used.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches per data-parallel rank and step"
    )
    parser.add_argument("--global-batch", type=int, default=24, help="sequences per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=2, help="rollout batches")
    parser.add_argument(
        "--mini-batches", type=int, default=1, help="PPO mini-batches (optimizer steps) per batch"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-dir", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. algo.policy_loss=grpo")
    args = parser.parse_args(argv)

    from cwgrpo_megatron.megatron import layout_check
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    torch.set_num_threads(1)
    init_distributed()
    try:
        result = layout_check.run(
            tp=args.tp,
            pp=args.pp,
            micro_batches=args.micro_batches,
            global_batch=args.global_batch,
            group_size=args.group_size,
            seq_len=args.seq_len,
            steps=args.steps,
            mini_batches=args.mini_batches,
            seed=args.seed,
            hf_dir=args.hf_dir,
            overrides=args.overrides,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        shutdown()
        return 2
    if torch.distributed.get_rank() == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {k: result[k] for k in ("loss", "grad_norm", "param_checksum", "layout")}
        with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
            json.dump(payload, f, indent=2)
        os.replace(f.name, out)
        print(json.dumps(payload))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
