"""Does a run's HF export hold the weights of its final checkpoint? Compared through logits."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.harness import run_distributed


def _max_logit_gap(rank, world_size, hf_dir: str, ckpt: str, start_hf: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.checks.sync_check import fixed_sequences
    from cwgrpo_megatron.config import load_config
    from cwgrpo_megatron.megatron import parallel, train_checkpoint
    from cwgrpo_megatron.megatron.forward import forward_logits

    cfg = load_config(Path(ckpt).parents[1] / "config.yaml")  # the run's resolved config
    actor, arch = layout_check.tiny_actor(cfg, hf_dir=start_hf)
    try:
        train_checkpoint.load(actor, ckpt)
        tokens = fixed_sequences(arch.vocab_size, batch=3, seq_len=20, seed=5)
        ours = forward_logits(actor.model, tokens)[..., : arch.vocab_size].float()
    finally:
        parallel.destroy()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    start = AutoModelForCausalLM.from_pretrained(start_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        moved = (start(tokens).logits.float() - theirs).abs().max()
    assert moved > 1e-3, "the export equals the start model: training changed nothing"
    return float((ours - theirs).abs().max())


def export_matches_checkpoint(hf_dir: Path, ckpt: Path, start_hf: Path) -> float:
    """max |logits| difference between transformers on `hf_dir` and our Megatron model loaded
    from the training checkpoint `ckpt` (one process)."""
    (gap,) = run_distributed(_max_logit_gap, 1, str(hf_dir), str(ckpt), str(start_hf), timeout=300)
    return gap
