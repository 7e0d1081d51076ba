"""Prove a parallel layout against TP1: run real CW-GRPO train steps and write the results.

    torchrun --nproc-per-node TP*PP*DP tools/check_layout.py --tp 2 --pp 1 \\
        --micro-batches 1 --global-batch 24 --steps 2 --out result.json [--hf-dir D]

Runs --steps optimizer steps of the real train step (cw_grpo, global scope unless overridden)
on a fixed seeded synthetic batch of prompts, responses and rewards that does not depend on the
layout, then writes JSON with `loss` and `grad_norm` (one per step), `param_checksum` (float64
sum of all parameters after the last step, each counted once across ranks) and `layout`.
Without --hf-dir a built-in tiny random Qwen2 is used. Compare the JSON of a new layout with
a TP1 run before a long job.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def tiny_qwen2(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=1000,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


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
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. algo.policy_loss=grpo")
    args = parser.parse_args(argv)

    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown
    from cwgrpo_megatron.megatron.model import load_hf_weights
    from cwgrpo_megatron.megatron.train_step import build_trainer, param_checksum, train_step

    torch.set_num_threads(1)
    init_distributed()
    world = torch.distributed.get_world_size()
    if args.global_batch % args.group_size:
        print("error: --global-batch must be a multiple of --group-size", file=sys.stderr)
        return 2
    prompts = args.global_batch // args.group_size
    dp = world // (args.tp * args.pp) if world % (args.tp * args.pp) == 0 else 0
    rows_per_rank = args.global_batch // max(dp, 1)
    defaults = [
        f"parallel.tp={args.tp}",
        f"parallel.pp={args.pp}",
        "algo.policy_loss=cw_grpo",
        "algo.cov_scope=global",
        f"train.prompts_per_step={prompts}",
        f"train.group_size={args.group_size}",
        f"train.total_steps={args.steps}",
        f"train.micro_batch_size={max(rows_per_rank // args.micro_batches, 1)}",
        "train.temperature=1.0",
        "optim.optimizer=sgd",
        "optim.lr=0.05",
        "optim.warmup_ratio=0",
        "optim.min_lr_ratio=1.0",
        "optim.clip_grad=0",
    ]
    try:
        cfg = load_config(overrides=defaults + list(args.overrides))
        cfg.check_world(world)
        if rows_per_rank % args.micro_batches:
            raise ValueError(
                f"{rows_per_rank} rows per rank do not split into "
                f"{args.micro_batches} micro-batches"
            )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if args.hf_dir:
        from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint

        arch, get = ModelArch.from_hf_dir(args.hf_dir), HFCheckpoint(args.hf_dir).get
    else:
        hf = tiny_qwen2(args.seed)
        state = hf.state_dict()
        arch, get = ModelArch.from_hf_dict(hf.config.to_dict()), state.__getitem__
    parallel.initialize(tp=args.tp, pp=args.pp, seed=cfg.train.seed)
    trainer = build_trainer(cfg, arch, lambda model: load_hf_weights(model, arch, get))
    losses, norms = [], []
    for step in range(args.steps):
        batch = synthetic_batch(
            prompts=prompts,
            group_size=args.group_size,
            seq_len=args.seq_len,
            vocab_size=arch.vocab_size,
            seed=args.seed * 1000 + step,
        )
        for result in train_step(trainer, batch):
            losses.append(result.loss)
            norms.append(result.grad_norm)
    checksum = param_checksum(trainer.model)
    layout = {**parallel.layout(), "micro_batches": args.micro_batches}
    if torch.distributed.get_rank() == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"loss": losses, "grad_norm": norms, "param_checksum": checksum, "layout": layout}
        with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
            json.dump(payload, f, indent=2)
        os.replace(f.name, out)
        print(json.dumps(payload))
    parallel.destroy()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
