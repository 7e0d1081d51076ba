"""How much a bf16 engine's numerics move CW-GRPO's weights when the statistics come from its
log-probs (algo.stats_logp=rollout): SmolLM2-135M-Instruct on configs/compare_cpu.yaml's task.

For --batches batches of P prompts x G completions (sampled by our torch engine at temperature 1
in fp32, rewarded by the task's verifier, group advantages), the completions' log-probs are
scored in several ways, and cw_grpo's statistics over the global pool
(`CovarianceWeightedLoss.prepare`: c, sigma, w~) computed from each:

    fp32       the model in float32: the trainer's numerics on CPU, the reference
    bf16       the same weights in bfloat16: a bf16 engine's rounding (its per-token gap to fp32
               is measured here)
    noise x k  fp32 plus Gaussian noise on every token whose mean |.| is k times the measured
               bf16 gap (k = 1 and 10: an engine whose kernels add to the rounding)

Per scoring: the mean |l - l_fp32| over counted tokens, sigma's relative change, and w~'s change
against the fp32 weights (mean and max |dw~| over counted tokens, and their correlation).
Target: at the measured bf16 gap, mean |dw~| <= 0.01 and |d sigma| / sigma <= 1% (w~ has mean
1, so 0.01 is 1% of it).

Usage: python benchmarks/bench_stats_noise.py [--quick] [--batches N] [--model DIR]
(default model: models/smollm2-135m-instruct, made by tools/import_gguf.py; --quick: a tiny
random Qwen2, one batch, coin-flip rewards)
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NOISE_SCALES = (1, 10)
TARGET_W, TARGET_SIGMA = 0.01, 0.01


class CoinFlips:
    """A reward of seeded 0 / 1 draws (--quick, whose random model never answers right)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, *, completions, answers) -> list[float]:
        return torch.randint(0, 2, (len(completions),), generator=self.gen).float().tolist()

    def close(self) -> None:
        pass


def token_logprobs(model, batch) -> torch.Tensor:
    """log p(labels) `[b, s]` at temperature 1, zero outside the loss mask (fp32 arithmetic on
    the model's logits)."""
    with torch.no_grad():
        logits = model(batch.tokens).logits.float()
    logp = logits.log_softmax(-1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    return logp * batch.loss_mask


def weights_of(logp: torch.Tensor, batch) -> tuple[torch.Tensor, float]:
    """(w~ `[b, s]`, sigma) of cw_grpo over the whole batch as one pool."""
    from cwgrpo_megatron.algo import get_policy_loss
    from cwgrpo_megatron.algo.config import AlgoConfig
    from cwgrpo_megatron.algo.metrics import finalize
    from cwgrpo_megatron.comm import make_scope

    prepared = get_policy_loss("cw_grpo").prepare(
        logp,
        batch.advantages,
        batch.loss_mask,
        scope=make_scope("global", batch_size=batch.rows),
        cfg=AlgoConfig(),
    )
    return prepared.token_stat, float(finalize(prepared.metrics)["cw/sigma"])


def sample_batch(engine, tokenizer, reward, problems, *, group: int, tokens: int, seed: int):
    from cwgrpo_megatron.data.batching import build_train_batch
    from cwgrpo_megatron.data.prompts import PromptFormat
    from cwgrpo_megatron.rollout.base import SamplingConfig

    prompt_ids = PromptFormat(system="You are a helpful assistant.").token_ids(
        [p["problem"] for p in problems], tokenizer
    )
    groups = engine.generate(
        prompt_ids, group, SamplingConfig(temperature=1.0, max_tokens=tokens, seed=seed)
    )
    texts = [tokenizer.decode(c.token_ids) for g in groups for c in g.completions]
    answers = [p["answer"] for p in problems for _ in range(group)]
    rewards = torch.tensor(reward(completions=texts, answers=answers)).view(len(problems), group)
    return build_train_batch(
        prompts=prompt_ids,
        responses=[[c.token_ids for c in g.completions] for g in groups],
        rewards=rewards,
    )


def compare(batches, fp32_model, bf16_model, seed: int):
    """({scoring: gap, sigma's relative change, mean / max |dw~|, corr(w~, w~_fp32)}, as means
    over the batches with a learning signal (sigma > 0), max |dw~| the largest; how many)."""
    rows: dict[str, list[dict[str, float]]] = {}
    gen = torch.Generator().manual_seed(seed)
    for batch in batches:
        mask = batch.loss_mask > 0
        base = token_logprobs(fp32_model, batch)
        w0, sigma0 = weights_of(base, batch)
        if not sigma0 > 0:
            continue
        bf16 = token_logprobs(bf16_model, batch)
        gap = float((bf16 - base).abs()[mask].mean())
        scorings = {"bf16": bf16}
        for k in NOISE_SCALES:
            # E|N(0, s)| = s sqrt(2 / pi)
            s = k * gap * math.sqrt(math.pi / 2)
            noise = torch.randn(base.shape, generator=gen) * s
            scorings[f"noise x {k}"] = (base + noise) * batch.loss_mask
        for name, logp in scorings.items():
            w, sigma = weights_of(logp, batch)
            dw = (w - w0).abs()[mask]
            pair = torch.stack([w[mask], w0[mask]]).double()
            rows.setdefault(name, []).append(
                {
                    "gap": float((logp - base).abs()[mask].mean()),
                    "sigma": abs(sigma - sigma0) / sigma0,
                    "dw_mean": float(dw.mean()),
                    "dw_max": float(dw.max()),
                    "corr": float(torch.corrcoef(pair)[0, 1]),
                }
            )
    table = {
        name: {k: (max if k == "dw_max" else statistics.fmean)(r[k] for r in runs) for k in runs[0]}
        for name, runs in rows.items()
    }
    return table, len(rows.get("bf16", []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random Qwen2, one batch")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch (the compare run's)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--tokens", type=int, default=16, help="tokens per completion")
    p.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.data.synthetic import generate
    from cwgrpo_megatron.reward import build_reward
    from cwgrpo_megatron.rollout.torch_engine import TorchEngine

    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-stats-noise-") as tmp:
        model_dir = Path(args.model)
        if args.quick:
            from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

            args.batches = 1
            model_dir = Path(tmp) / "tiny"
            save_tiny_qwen2(model_dir)
        elif not (model_dir / "config.json").is_file():
            print(
                f"error: no HF model in {model_dir}: run python tools/import_gguf.py --out "
                f"{model_dir} (or pass --model DIR, or --quick)",
                file=sys.stderr,
            )
            return 2
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
        engine = TorchEngine(model_dir, seed=args.seed, max_model_len=512)
        reward = build_reward(load_config("configs/compare_cpu.yaml").reward)
        if args.quick:  # a random model earns no reward: seeded coin flips give a signal
            reward.close()
            reward = CoinFlips(args.seed)
        problems = generate("larger", args.batches * args.prompts, seed=args.seed)
        try:
            batches = [
                sample_batch(
                    engine,
                    tokenizer,
                    reward,
                    problems[i * args.prompts : (i + 1) * args.prompts],
                    group=args.group,
                    tokens=args.tokens,
                    seed=args.seed * 1000 + i,
                )
                for i in range(args.batches)
            ]
        finally:
            reward.close()
            engine.shutdown()
        result, scored = compare(batches, fp32, bf16, args.seed)
    counted = sum(int(b.loss_mask.sum()) for b in batches)
    print(
        f"{model_dir.name}: {args.batches} batches of {args.prompts} x {args.group} completions of "
        f"{args.tokens} tokens ({counted} counted tokens); "
        f"{scored} with a learning signal; "
        "cw_grpo statistics against those of the fp32 log-probs"
    )
    if not result:
        print("target: not measured (no batch had a learning signal: every group's rewards equal)")
        return 0
    print(f"{'scoring':<12} {'mean gap':>10} {'d sigma':>9} {'mean |dw|':>10} {'max |dw|':>9} "
          f"{'corr(w)':>9}")  # fmt: skip
    for name, r in result.items():
        print(
            f"{name:<12} {r['gap']:>10.2e} {r['sigma']:>8.3%} {r['dw_mean']:>10.2e} "
            f"{r['dw_max']:>9.2e} {r['corr']:>9.6f}"
        )
    b = result["bf16"]
    met = b["dw_mean"] <= TARGET_W and b["sigma"] <= TARGET_SIGMA
    print(
        f"target at the bf16 gap: mean |dw~| <= {TARGET_W} and d sigma <= {TARGET_SIGMA:.0%}: "
        f"{'met' if met else 'MISSED'} ({b['dw_mean']:.2e}, {b['sigma']:.3%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
