"""Tiny random Qwen2 / Llama models built with transformers from a config (nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)

# name -> (config class, model class, overrides)
CONFIGS = {
    "qwen-untied": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(vocab_size=1000, tie_word_embeddings=False),
    ),
    "qwen-tied": (Qwen2Config, Qwen2ForCausalLM, dict(vocab_size=1000, tie_word_embeddings=True)),
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(vocab_size=1000, tie_word_embeddings=False, attention_bias=False),
    ),
}


def make_hf_model(name: str, seed: int = 0):
    config_cls, model_cls, overrides = CONFIGS[name]
    arch = "Qwen2ForCausalLM" if config_cls is Qwen2Config else "LlamaForCausalLM"
    config = config_cls(**BASE, **overrides, architectures=[arch])
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random biases and norms, so that their mapping is exercised
        for name_, p in model.named_parameters():
            if name_.endswith("bias") or "norm" in name_:
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(batch: int = 4, seq: int = 12, vocab: int = 1000, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)
