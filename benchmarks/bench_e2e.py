"""Whole training steps: our trainer against TRL's GRPOTrainer, on CPU, in one run.

Both sides get the same HF model (a tiny random Qwen2 and one of about 100M parameters, the
shape of bench_rollout.py), the same prompts, group size, completion length, reward, KL
coefficient, learning rate and number of optimizer steps, fp32, and one micro-batch per step.
Each side runs in its own subprocess of this script (neither can disturb the other's process
state), takes `--warmup` untimed steps, then `--steps` timed ones; the table gives the mean
seconds of each phase and the ratio of steps per second.

    ours  python -m cwgrpo_megatron.train's loop (`build_trainer`, `train_one_step`), vLLM
          in-process, Megatron-Core with gloo, in three arms (ARMS): cw_grpo with the
          statistics from the trainer (a forward-only pass before the training pass), cw_grpo
          with algo.stats_logp=rollout (the engine's log-probs: no pass) and grpo (no pass);
          phases from its timing_s/* metrics (old_logp: the forward-only passes, here the
          reference model's and, in the first arm, the policy's)
    TRL   GRPOTrainer with its default generation (transformers `generate`; its vLLM modes
          are not run here); phases from timers around `_generate_single_turn`
          (rollout), `_calculate_rewards` (reward), the rest of `_generate_and_score_completions`
          (old_logp: TRL computes reference log-probs there and, with one update per batch, no
          old ones), and the remainder of the step (train: forward, backward, optimizer)

Completions have no end token (`end_tokens=0`), so every completion of both sides is exactly
`--tokens` long and the two do the same work whatever they sample.

Targets (issue "one forward pass fewer"): ours >= 1.5x TRL's steps/s at ~100M for cw_grpo with
algo.stats_logp=rollout and for grpo; the first arm's ratio is printed beside them.

Usage: python benchmarks/bench_e2e.py [--quick] [--steps N] [--warmup N] [--arms A,B]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench_rollout import MODELS as ROLLOUT_MODELS  # noqa: E402  (this folder is on sys.path)

MODELS = {"tiny": ROLLOUT_MODELS["tiny (3M)"], "~100M": ROLLOUT_MODELS["~100M"]}
PHASES = ("rollout", "reward", "old_logp", "train", "sync", "step")
ARMS = {
    "cw_grpo": ["algo.policy_loss=cw_grpo"],
    "cw_grpo+rollout": ["algo.policy_loss=cw_grpo", "algo.stats_logp=rollout"],
    "grpo": ["algo.policy_loss=grpo"],
}
"""Our settings, each run against the same TRL run."""
TARGETS = {"cw_grpo+rollout": 1.5, "grpo": 1.5}


def write_prompts(path: Path, count: int) -> Path:
    """Short arithmetic problems with integer answers (plain text: no chat template)."""
    rows = [
        {"problem": f"What is {i} plus {2 * i + 1}?", "answer": str(3 * i + 1)}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ours(args, hf_dir: Path, data: Path, out: Path) -> dict:
    """Per-step phase seconds of our trainer in arm `args.arm` (one process, vLLM
    in-process)."""
    from cwgrpo_megatron.build import build_trainer
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.megatron.launch import init_distributed, shutdown

    overrides = [
        f"model.path={hf_dir}",
        "model.chat_template=plain",
        f"data.train_files=[{data}]",
        f"data.max_prompt_tokens={args.prompt_tokens}",
        *ARMS[args.arm],
        f"algo.kl_beta={args.kl_beta}",
        "train.total_steps=1000",  # never reached: no final checkpoint inside the timed steps
        f"train.prompts_per_step={args.prompts}",
        f"train.group_size={args.group}",
        f"train.micro_batch_size={args.prompts * args.group}",
        "train.temperature=1.0",
        f"optim.lr={args.lr}",
        "optim.adam_beta2=0.999",  # TRL's (transformers') AdamW default
        "optim.warmup_ratio=0",
        "rollout.backend=vllm",
        f"rollout.max_tokens={args.tokens}",
        f"rollout.max_model_len={args.prompt_tokens + args.tokens}",
        "reward.weights={accuracy: 1.0, format: 1.0}",
        "reward.workers=1",
        f"run.out_dir={out}",
        "run.save_every=0",
        "run.export_hf=never",
        "logging.tensorboard=false",
    ]
    init_distributed()
    try:
        trainer = build_trainer(load_config(overrides=overrides))
        try:
            rows = [trainer.train_one_step() for _ in range(args.warmup + args.steps)]
        finally:
            trainer.close()
    finally:
        shutdown()
    timed = rows[args.warmup :]
    return {p: statistics.mean(r[f"timing_s/{p}"] for r in timed) for p in PHASES}


def trl(args, hf_dir: Path, data: Path, out: Path) -> dict:
    """Per-step phase seconds of TRL's GRPOTrainer with the same settings."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from cwgrpo_megatron.config import load_config

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": f"{r['problem']}\n", "answer": r["answer"]} for r in rows]
    )
    from cwgrpo_megatron.reward import build_reward

    reward = build_reward(
        load_config(
            overrides=["reward.weights={accuracy: 1.0, format: 1.0}", "reward.workers=1"]
        ).reward
    )

    def same_reward(prompts, completions, completion_ids, answer, **_):
        lengths = [len(ids) for ids in completion_ids]
        return reward(completions=completions, answers=answer, completion_lengths=lengths)

    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.tokens,
        gradient_accumulation_steps=1,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=args.kl_beta,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.padding_side = "left"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=same_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    seconds: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    trainer._generate_single_turn = timed("rollout", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed(
        "prepare", trainer._generate_and_score_completions
    )
    steps: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            seconds.clear()
            seconds["start"] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            total = time.perf_counter() - seconds["start"]
            prepare = seconds.get("prepare", 0.0)
            steps.append(
                {
                    "rollout": seconds.get("rollout", 0.0),
                    "reward": seconds.get("reward", 0.0),
                    "old_logp": prepare - seconds.get("rollout", 0.0) - seconds.get("reward", 0.0),
                    "train": total - prepare,
                    "sync": 0.0,  # the policy generates: nothing to sync
                    "step": total,
                }
            )

    trainer.add_callback(StepClock())
    try:
        trainer.train()
    finally:
        reward.close()
    timed_steps = steps[args.warmup :]
    return {p: statistics.mean(s[p] for s in timed_steps) for p in PHASES}


def run_side(side: str, args, model: str, folder: Path, arm: str | None = None) -> dict:
    """One side (ours in `arm`) in a fresh subprocess of this script; its phase means."""
    cmd = [
        sys.executable,
        __file__,
        "--side",
        side,
        *(["--arm", arm] if arm else []),
        "--model",
        model,
        "--folder",
        str(folder),
        *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in TUNABLE),
    ]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(
            f"{side} {arm or ''} on {model} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


TUNABLE = ("prompts", "group", "tokens", "prompt_tokens", "steps", "warmup", "lr", "kl_beta")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model only, one timed step")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per side")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length limit")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--kl-beta", type=float, default=0.04)
    p.add_argument(
        "--arms", default=",".join(ARMS), help=f"our arms, comma-separated (of {', '.join(ARMS)})"
    )
    p.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.side:  # a child: one side, one model, JSON on the last line
        folder = Path(args.folder)
        fn = ours if args.side == "ours" else trl
        result = fn(args, folder / "hf", folder / "prompts.jsonl", folder / f"out_{args.side}")
        print(json.dumps(result))
        return 0
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        print(f"error: unknown arms {unknown}; choose from {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if args.quick:
        args.steps = 1
    models = ["tiny"] if args.quick else list(MODELS)
    print(
        f"{args.prompts} prompts x {args.group} completions of {args.tokens} tokens, kl_beta "
        f"{args.kl_beta}, {args.warmup} warm-up + {args.steps} timed steps per side; "
        "seconds per step (mean)"
    )
    width = max(len(a) for a in arms) + 5
    print(f"{'model':<7} {'side':<{width}} " + " ".join(f"{p:>9}" for p in PHASES))
    speedups = {}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        for name in models:
            folder = Path(tmp) / name.strip("~")
            save_tiny_qwen2(folder / "hf", **MODELS[name])
            write_prompts(folder / "prompts.jsonl", 64)
            results = {f"ours {a}": run_side("ours", args, name, folder, a) for a in arms}
            results["trl"] = run_side("trl", args, name, folder)
            for side, phases in results.items():
                row = " ".join(f"{phases[p]:>9.3f}" for p in PHASES)
                print(f"{name:<7} {side:<{width}} {row}")
            for arm in arms:
                speedups[name, arm] = results["trl"]["step"] / results[f"ours {arm}"]["step"]
                print(f"{name:<7} ours {arm} / TRL steps per second: {speedups[name, arm]:.2f}x")
    for arm in arms:
        target = TARGETS.get(arm)
        if target is None:
            continue
        if ("~100M", arm) in speedups:
            got = speedups["~100M", arm]
            met = "met" if got >= target else "MISSED"
            print(f"target ours {arm} >= {target}x TRL at ~100M: {met} ({got:.2f}x)")
        else:
            print(f"target ours {arm} >= {target}x TRL at ~100M: not measured (--quick)")
    if not any(arm in TARGETS for arm in arms):
        print(f"targets ({', '.join(TARGETS)}): not measured (no arm with a target chosen)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
