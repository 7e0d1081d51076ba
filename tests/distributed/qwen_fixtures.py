"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE / Llama models built with transformers from a config
(nothing downloaded)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from cwgrpo_megatron.checks.tiny import TINY_QWEN2, perturb

# the architecture of the layout check's tiny Qwen2, with vocab / tying / class set per case
BASE = {
    k: v
    for k, v in TINY_QWEN2.items()
    if k not in ("vocab_size", "tie_word_embeddings", "architectures")
}

TINY_MOE = dict(
    vocab_size=1000,
    tie_word_embeddings=False,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)

# name -> (config class, model class, overrides)
CONFIGS = {
    "qwen-untied": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(vocab_size=1000, tie_word_embeddings=False),
    ),
    "qwen-tied": (Qwen2Config, Qwen2ForCausalLM, dict(vocab_size=1000, tie_word_embeddings=True)),
    # Qwen3: QK norm, no QKV bias, and a head_dim (32) that is not hidden / heads (16)
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(vocab_size=1000, tie_word_embeddings=False, head_dim=32),
    ),
    "qwen3-tied": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(vocab_size=1000, tie_word_embeddings=True, head_dim=32),
    ),
    # Qwen3-MoE: 4 experts of width 32, top-2, both ways of weighting the chosen experts
    "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(TINY_MOE, norm_topk_prob=True)),
    "qwen3-moe-unnorm": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(TINY_MOE, norm_topk_prob=False),
    ),
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(vocab_size=1000, tie_word_embeddings=False, attention_bias=False),
    ),
    # Llama 3.1's RoPE scaling: with head_dim 16 the slowest frequencies have wavelengths past
    # 8192 / low_freq_factor, so the scaling changes them
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            vocab_size=1000,
            tie_word_embeddings=False,
            attention_bias=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
}


def make_hf_model(name: str, seed: int = 0):
    config_cls, model_cls, overrides = CONFIGS[name]
    arch = model_cls.__name__
    config = config_cls(**BASE, **overrides, architectures=[arch])
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    perturb(model)
    return model


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors as a checkpoint holds them: what `save_pretrained` writes, e.g. one
    tensor per expert where transformers fuses the experts in memory."""
    # under torch.distributed transformers writes on rank 0 only; each rank here has a model of
    # its own and a folder of its own
    model.should_save_on_this_rank = lambda is_main_process: True
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            tensors.update(load_file(path))
    return tensors


def tokens(batch: int = 4, seq: int = 12, vocab: int = 1000, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)
