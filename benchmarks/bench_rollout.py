"""Generation throughput: our vLLM engine wrapper vs raw `vllm.LLM.generate` vs the torch
fallback, on the same requests, measured in one run.

For a tiny Qwen2 and one of about 100M parameters (random weights, saved with transformers),
each setup generates n completions of `max_tokens` for the same seeded prompts; tokens/s counts
the completion tokens produced. The wrapper and raw vLLM share one in-process engine and run
alternately, best of `--repeats`.

Target (issue "vLLM rollout engine"): wrapper >= 0.95x raw vLLM. The vLLM / fallback ratio is
printed too.

Usage: python benchmarks/bench_rollout.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "tiny (3M)": dict(),
    "~100M": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=1024,
    ),
}


def best_rate(fn, repeats: int) -> float:
    """max over repeats of generated tokens / s."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def bench_model(name, overrides, *, prompts, n, max_tokens, repeats, folder):
    import torch
    from vllm import SamplingParams

    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2
    from cwgrpo_megatron.rollout import SamplingConfig, get_engine

    hf_dir = save_tiny_qwen2(Path(folder) / name.split()[0], **overrides)
    vocab = overrides.get("vocab_size", 512)
    gen = torch.Generator().manual_seed(0)
    requests = [
        torch.randint(1, vocab, (int(k),), generator=gen).tolist()
        for k in torch.randint(16, 48, (prompts,), generator=gen)
    ]
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, seed=1)
    engine = get_engine("vllm")(hf_dir, max_model_len=max_tokens + 64, seed=0)
    fallback = get_engine("torch")(hf_dir, max_model_len=max_tokens + 64, seed=0)

    def ours():
        groups = engine.generate(requests, n, sampling)
        return sum(len(c.token_ids) for g in groups for c in g.completions)

    # the wrapper's exact parameters, so the ratio is the wrapper's overhead alone
    raw_params = [
        SamplingParams(
            n=n,
            temperature=1.0,
            max_tokens=max_tokens,
            logprobs=0,
            seed=1 + i * n,
            detokenize=False,
        )
        for i in range(len(requests))
    ]

    def raw():
        outs = engine.llm.generate(
            [{"prompt_token_ids": p} for p in requests], raw_params, use_tqdm=False
        )
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def torch_fallback():
        groups = fallback.generate(requests, n, sampling)
        return sum(len(c.token_ids) for g in groups for c in g.completions)

    ours(), raw()  # warm-up
    rates = {"ours": 0.0, "raw": 0.0}
    for _ in range(repeats):  # alternate, so drift hits both alike
        rates["ours"] = max(rates["ours"], best_rate(ours, 1))
        rates["raw"] = max(rates["raw"], best_rate(raw, 1))
    rates["torch"] = best_rate(torch_fallback, max(1, repeats // 2))
    engine.llm = None  # dropped, not shut down: the next model's engine reuses the process
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few tokens (smoke)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    models = {"tiny (3M)": MODELS["tiny (3M)"]} if args.quick else MODELS
    shape = (
        dict(prompts=4, n=2, max_tokens=16) if args.quick else dict(prompts=8, n=4, max_tokens=64)
    )
    print(f"requests: {shape['prompts']} prompts x n={shape['n']} x {shape['max_tokens']} tokens")
    print(
        f"{'model':<10} {'ours tok/s':>11} {'raw vLLM':>10} {'torch':>9} {'ours/raw':>9} "
        f"{'vLLM/torch':>11}"
    )
    met = True
    with tempfile.TemporaryDirectory() as folder:
        for name, overrides in models.items():
            r = bench_model(name, overrides, repeats=args.repeats, folder=folder, **shape)
            ratio = r["ours"] / r["raw"]
            met &= ratio >= 0.95
            print(
                f"{name:<10} {r['ours']:>11.0f} {r['raw']:>10.0f} {r['torch']:>9.0f} "
                f"{ratio:>8.3f}x {r['raw'] / r['torch']:>10.2f}x"
            )
    print(f"target wrapper >= 0.95x raw vLLM: {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
