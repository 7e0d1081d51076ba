"""vLLM on CPU, eager vs compiled (torch.compile, vLLM's default when not `enforce_eager`):
the one-time cost of compiling against the per-step gain, on the demo's rollouts.

Each mode runs in a fresh process (an in-process vLLM engine cannot be started twice in one
process), on the same HF checkpoint and the same requests: the demo's shape, `--prompts`
prompts x `--n` samples x `--max-tokens` tokens, the full distribution (temperature 1,
top_k 0, top_p 1). The compiled mode runs twice, first with an empty vLLM compile cache (what
a fresh machine pays) and then with the cache that run left. Per mode it prints:

- start: seconds from `VLLMEngine(...)` to a ready engine (compilation happens here);
- first: the first `generate` (any lazy compile / warm-up left);
- step: the mean of the next `--repeats` `generate` calls, and tokens/s;
- after a weight push (`load_stream` with every tensor scaled by 1.001), the prompt
  log-probs of a fixed sequence: the compiled engine must read the new weights exactly as the
  eager one does (max |diff| is printed), or its speed would not matter.

Break-even steps = (start + first, compiled - eager) / (step eager - step compiled).

Usage: python benchmarks/bench_vllm_compile.py --hf-dir models/smollm2-135m-instruct
(`--quick`: a smoke run on a tiny random Qwen2, eager only.)

Measured on 2 idle CPU cores (docs/results.md, "The demo"): eager 31 s to start, 8.46 s a rollout;
compiled 162 s (112 s with a warm cache), 8.18 s (7.50 s): it pays after about 470 (84) steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def requests(hf_dir: str, prompts: int) -> list[list[int]]:
    """The demo's prompts: SmolLM2's chat template around the synthetic repeat task."""
    from transformers import AutoTokenizer

    from cwgrpo_megatron.data.synthetic import generate

    tok = AutoTokenizer.from_pretrained(hf_dir)
    rows = generate("repeat", prompts, seed=0)
    if not tok.chat_template:  # --quick's tiny model
        return [tok.encode(row["problem"]) for row in rows]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": row["problem"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for row in rows
    ]


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from cwgrpo_megatron.rollout import SamplingConfig, get_engine

    reqs = requests(args.hf_dir, args.prompts)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    engine = get_engine("vllm")(
        args.hf_dir, max_model_len=128, seed=0, enforce_eager=args.mode == "eager"
    )
    start = time.perf_counter() - t0

    def gen(step: int) -> tuple[float, int]:
        t = time.perf_counter()
        groups = engine.generate(reqs, args.n, sampling, seeds=None)
        del step
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        return time.perf_counter() - t, tokens

    first, _ = gen(0)
    times, tokens = [], 0
    for i in range(args.repeats):
        dt, k = gen(i + 1)
        times.append(dt)
        tokens += k
    from safetensors.torch import load_file

    weights = load_file(str(Path(args.hf_dir) / "model.safetensors"))
    engine.load_stream((name, t * 1.001) for name, t in weights.items())
    logp = engine.prompt_logprobs([reqs[0] + reqs[1]])[0]
    engine.shutdown()
    return dict(
        start=start,
        first=first,
        step=sum(times) / len(times),
        tok_s=tokens / sum(times),
        logp=logp,
    )


def run_mode(args, mode: str, cache: str) -> dict:
    env = dict(os.environ, VLLM_CACHE_ROOT=cache)
    if mode != "eager":
        env.pop("TORCHDYNAMO_DISABLE", None)
    cmd = [sys.executable, __file__, "--child", mode, "--hf-dir", args.hf_dir]
    for key in ("prompts", "n", "max_tokens", "repeats", "threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"{mode} run failed ({out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", default="models/smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--demo-steps", type=int, default=8, help="the demo's training steps")
    parser.add_argument("--eager-only", action="store_true", help="the eager baseline alone")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: a tiny random Qwen2, eager only, 1 repeat"
    )
    parser.add_argument("--child", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory() as cache:
        if args.quick:
            from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

            args.hf_dir = save_tiny_qwen2(cache + "/tiny")
            args.prompts, args.n, args.max_tokens, args.repeats = 2, 2, 4, 1
            args.eager_only = True
        runs = {"eager": run_mode(args, "eager", cache + "/eager")}
        if args.eager_only:
            print(json.dumps(runs["eager"] | {"logp": None}))
            print("target: not judged (eager only: no compiled run to weigh)")
            return 0
        runs["compiled (cold cache)"] = run_mode(args, "compiled", cache + "/compiled")
        runs["compiled (warm cache)"] = run_mode(args, "compiled", cache + "/compiled")
    print(
        f"SmolLM2 rollouts: {args.prompts} prompts x {args.n} x {args.max_tokens} tokens, "
        f"{args.threads} threads"
    )
    print(f"{'mode':<22} {'start s':>8} {'first s':>8} {'step s':>7} {'tok/s':>6} {'logp gap':>9}")
    eager = runs["eager"]
    for name, r in runs.items():
        gap = max(abs(a - b) for a, b in zip(r["logp"], eager["logp"], strict=True))
        print(
            f"{name:<22} {r['start']:>8.1f} {r['first']:>8.2f} {r['step']:>7.2f} "
            f"{r['tok_s']:>6.0f} {gap:>9.1e}"
        )
    pays = []
    for name in ("compiled (cold cache)", "compiled (warm cache)"):
        r = runs[name]
        cost = (r["start"] + r["first"]) - (eager["start"] + eager["first"])
        gain = eager["step"] - r["step"]
        steps = cost / gain if gain > 0 else math.inf
        pays.append(steps <= args.demo_steps)
        verdict = f"pays after {steps:.1f} steps" if gain > 0 else "never pays (no gain)"
        print(
            f"{name}: one-time cost {cost:+.1f} s, gain {gain:+.2f} s/step "
            f"({eager['step'] / r['step']:.2f}x): {verdict}"
        )
    choice = "compile (rollout.enforce_eager=false)" if pays[0] else "stay eager (the default)"
    print(
        f"target: compile only where it pays within the demo's {args.demo_steps} steps, from an "
        f"empty cache -> {choice}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
