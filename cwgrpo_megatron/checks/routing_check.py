"""How often a MoE model's routing differs between the trainer and a second implementation of
the same model on the same tokens, and what it does to the log-prob gap (check_routing.py).

The trainer (Megatron, `routing.recorded_routing`) and transformers score one fixed batch, in
fp32 and in bf16. A token counts as rerouted when any layer's top-k expert set differs. The
log-prob gap |log p_trainer - log p_hf| is reported over all tokens and split by rerouted or
not: the part of the rollout gap that routing adds (the gap that truncated IS then corrects).
vLLM reports its routing only on its V2 model runner (`enable_return_routed_experts`, Triton:
a GPU); transformers stands in for it here. One process (a world of one).
"""

from __future__ import annotations

import torch

from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
from cwgrpo_megatron.megatron import parallel
from cwgrpo_megatron.megatron.cpu import on_cpu
from cwgrpo_megatron.megatron.publish import score
from cwgrpo_megatron.megatron.routing import recorded_routing, topk_differ

DTYPES = ("float32", "bfloat16")


def _trainer(hf_dir: str, dtype: str, tokens: torch.Tensor):
    """(log-probs [b, s-1], top-k ids per layer [b s, k] in the batch's b-major order)."""
    cfg = layout_config(
        tp=1,
        pp=1,
        micro_batches=1,
        global_batch=tokens.shape[0],
        group_size=1,
        steps=1,
        world_size=1,
        overrides=[f"train.params_dtype={dtype}"],
    )
    actor, arch = tiny_actor(cfg, hf_dir=hf_dir)
    try:
        if not arch.is_moe:
            raise ValueError(f"{hf_dir} is a dense model ({arch.architecture}): no routing")
        b, s = tokens.shape
        with torch.no_grad(), on_cpu(), recorded_routing(actor.model) as calls:
            logp = score(actor.model, arch, tokens)
        # the router sees [s, b] tokens s-major; transformers b-major
        ids = [c.view(s, b, -1).transpose(0, 1).reshape(b * s, -1) for c in calls]
        return logp, ids, arch
    finally:
        parallel.destroy()


def _hf(hf_dir: str, dtype: str, tokens: torch.Tensor, topk: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
    with torch.no_grad():
        out = model(tokens, output_router_logits=True)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1)
    logp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ids = [r.float().topk(topk, dim=-1).indices.sort(dim=-1).values for r in out.router_logits]
    return logp, ids


def run(hf_dir: str, *, rows: int = 8, seq_len: int = 64, seed: int = 0) -> dict:
    """{dtype: {topk_differ, rerouted_tokens, gap_mean, gap_mean_rerouted, gap_mean_kept,
    gap_max}} and "fp32_vs_bf16_trainer": the trainer's own top-k differ between dtypes.
    Needs torch.distributed (a world of one)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(hf_dir).vocab_size
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(seed))
    out, trainer_ids = {}, {}
    for dtype in DTYPES:
        logp, ids, arch = _trainer(hf_dir, dtype, tokens)
        hf_logp, hf_ids = _hf(hf_dir, dtype, tokens, arch.moe_topk)
        trainer_ids[dtype] = ids
        # a token is rerouted where any layer's set differs; log-prob t predicts token t + 1
        # from position t, whose routing is column t
        rerouted = torch.stack([(a != b).any(-1) for a, b in zip(ids, hf_ids, strict=True)])
        rerouted_all = rerouted.any(0).view(rows, seq_len)
        rerouted = rerouted_all[:, :-1]
        gap = (logp - hf_logp).abs()
        out[dtype] = {
            "topk_differ": topk_differ(ids, hf_ids),
            "rerouted_tokens": float(rerouted_all.float().mean()),
            "gap_mean": float(gap.mean()),
            "gap_max": float(gap.max()),
            "gap_mean_rerouted": float(gap[rerouted].mean()) if rerouted.any() else None,
            "gap_mean_kept": float(gap[~rerouted].mean()) if (~rerouted).any() else None,
        }
    out["fp32_vs_bf16_trainer"] = topk_differ(*trainer_ids.values())
    out["setup"] = {"rows": rows, "seq_len": seq_len, "seed": seed, "layers": arch.num_layers}
    return out
