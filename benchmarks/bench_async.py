"""One-step-off rollouts against synchronous ones: the same task, trained both ways in one run.

Both runs place the engine apart from the trainer (rollout.placement=separate): on this
machine one core holds the vLLM engine's processes and the trainer keeps the other
(rollout.cpu_cores=1). The synchronous run (rollout.async_steps=0) generates, then trains, each
waiting for the other; the one-step-off run (async_steps=1) generates step k+1 while step k
trains. Everything else is equal: model, prompts, seeds, group size, completion length.

Each run is `python -m cwgrpo_megatron.train` in its own process; its metrics.jsonl gives the
phases. The first `--warmup` steps of each are left out (the first one-step-off step is
synchronous: nothing was made ahead of it), and so is the last (it saves the final checkpoint,
and makes nothing ahead). Per step (mean):

    generation   timing_s/rollout + timing_s/reward (made in the background when async)
    training     timing_s/old_logp + timing_s/train
    wait         timing_s/rollout_wait: the trainer waiting for the background generation
    step         timing_s/step

    hidden       in the async run, generation + training + sync - step: the time the
                 overlap saved (its own phases, so the two runs' noise does not enter)
    overlap      hidden / min(generation, training) of the async run: the share of the
                 smaller phase hidden (1: all of it)

The random model ends a completion on any of `--end-tokens` ids, so lengths vary and the
cosine length reward gives the groups a signal to learn from; the mean completion length of
each run is printed beside its times, since the two runs sample alike only at step 1. The
model's shape and the token counts are chosen so that generation and training take about as
long on one core each.

Target (issue "one-step-off-policy rollouts"): async step <= 0.75 x sync step when generation
and training take about as long.

Usage: python benchmarks/bench_async.py [--quick] [--steps N] [--warmup N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench_e2e import write_prompts  # noqa: E402  (this folder is on sys.path)

TARGET = 0.75
MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    vocab_size=32000,
    max_position_embeddings=512,
)
"""About 20M parameters (most of them the embedding and the output layer)."""


def overrides(args, hf_dir: Path, data: Path, out: Path, async_steps: int) -> list[str]:
    return [
        f"model.path={hf_dir}",
        "model.chat_template=plain",
        f"data.train_files=[{data}]",
        f"data.max_prompt_tokens={args.prompt_tokens}",
        "data.heldout_size=0",
        "algo.policy_loss=cw_grpo",
        "algo.kl_beta=0.0",
        f"train.total_steps={args.warmup + args.steps + 1}",
        f"train.prompts_per_step={args.prompts}",
        f"train.group_size={args.group}",
        f"train.micro_batch_size={args.group}",
        "train.temperature=1.0",
        f"optim.lr={args.lr}",
        "optim.warmup_ratio=0",
        f"rollout.max_tokens={args.tokens}",
        f"rollout.max_model_len={args.prompt_tokens + args.tokens}",
        "rollout.placement=separate",
        "rollout.cpu_cores=1",
        f"rollout.async_steps={async_steps}",
        "reward.weights={accuracy: 1.0, cosine_length: 1.0}",
        f"reward.options.cosine_length.max_len={args.tokens}",
        "reward.workers=1",
        f"run.out_dir={out}",
        "run.save_every=0",
        "run.eval_every=0",
        "run.export_hf=never",
        "eval.benchmarks=[]",
        "logging.tensorboard=false",
    ]


def run(args, folder: Path, async_steps: int) -> list[dict]:
    """One training run in its own process; its metrics lines."""
    out = folder / f"async_{async_steps}"
    cmd = [sys.executable, "-m", "cwgrpo_megatron.train"]
    cmd += overrides(args, folder / "hf", folder / "prompts.jsonl", out, async_steps)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"async_steps={async_steps} failed:\n{done.stderr[-5000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def phases(rows: list[dict]) -> dict[str, float]:
    def mean(*keys: str) -> float:
        return statistics.mean(sum(r[f"timing_s/{k}"] for k in keys) for r in rows)

    return {
        "tokens": statistics.mean(r["response_length/mean"] for r in rows),
        "generation": mean("rollout", "reward"),
        "training": mean("old_logp", "train"),
        "sync": mean("sync"),
        "wait": mean("rollout_wait"),
        "step": mean("step"),
    }


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 timed steps")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per run")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=2, help="completions per prompt")
    p.add_argument("--tokens", type=int, default=192, help="most tokens per completion")
    p.add_argument("--end-tokens", type=int, default=128, help="ids that end a completion")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length limit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("target async <= 0.75x sync: not measured (needs 2 cores: one each)")
        return 0
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    shape = {} if args.quick else MODEL
    if args.quick:
        args.steps, args.warmup, args.tokens = 2, 1, 16
    print(
        f"{args.prompts} prompts x {args.group} completions of <= {args.tokens} tokens, engine on "
        f"1 core, trainer on the other; {args.warmup} warm-up + {args.steps} timed steps per "
        "run; seconds per step (mean)"
    )
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        folder = Path(tmp)
        save_tiny_qwen2(folder / "hf", end_tokens=args.end_tokens, **shape)
        write_prompts(folder / "prompts.jsonl", 64)
        rows = {name: run(args, folder, steps) for name, steps in (("sync", 0), ("async", 1))}
    timed = {name: r[args.warmup : args.warmup + args.steps] for name, r in rows.items()}
    result = {name: phases(r) for name, r in timed.items()}
    columns = ("tokens", "generation", "training", "sync", "wait", "step")
    print(f"{'run':<6} " + " ".join(f"{c:>10}" for c in columns) + f" {'policy lag':>11}")
    for name, p in result.items():
        lag = statistics.mean(r["rollout/policy_lag"] for r in timed[name])
        print(f"{name:<6} " + " ".join(f"{p[c]:>10.3f}" for c in columns) + f" {lag:>11.0f}")
    sync, fast = result["sync"], result["async"]
    ratio = fast["step"] / sync["step"]
    hidden = fast["generation"] + fast["training"] + fast["sync"] - fast["step"]
    smaller = min(fast["generation"], fast["training"])
    balance = sync["generation"] / sync["training"]
    print(f"generation / training (sync): {balance:.2f}")
    print(f"async / sync step: {ratio:.2f}")
    print(f"overlap: {hidden:.3f} s hidden = {hidden / smaller:.0%} of the smaller phase")
    print("reward/mean by step (warm-up included):")
    for name, r in rows.items():
        print(f"  {name:<6} " + " ".join(f"{x['reward/mean']:+.3f}" for x in r))
    if args.quick:
        print(f"target async <= {TARGET}x sync: not measured (--quick runs the tiny model)")
    else:
        met = "met" if ratio <= TARGET else "MISSED"
        print(f"target async <= {TARGET}x sync at generation / training {balance:.2f}: {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
