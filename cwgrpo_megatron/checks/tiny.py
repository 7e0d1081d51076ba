"""The tiny random models of the self-checks, tests, demos and benchmarks, in one place
(nothing downloaded; each is built with transformers from a config):

    TINY_QWEN2         the layout check's model (`tiny_qwen2`): hidden 64, 4 layers, untied
    TINY_ENGINE_QWEN2  a checkpoint that vLLM can serve, with a locally trained tokenizer
                       (`save_tiny_qwen2`): vLLM's CPU attention needs a supported head size,
                       and hidden 128 with 4 heads gives 32
    TINY_ENGINE_QWEN3  the same as a Qwen3, with head_dim 64 (`save_tiny_qwen3`)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

TINY_QWEN2 = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=1000,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    architectures=["Qwen2ForCausalLM"],
)
TINY_ENGINE_QWEN2 = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    eos_token_id=0,
    bos_token_id=0,
)
TINY_ENGINE_QWEN3 = dict(head_dim=64)
"""Over TINY_ENGINE_QWEN2: a head size that vLLM's CPU attention takes, apart from hidden /
heads."""
TINY_ENGINE_QWEN3_MOE = dict(
    TINY_ENGINE_QWEN3,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    norm_topk_prob=True,
)
"""Over TINY_ENGINE_QWEN2: TINY_ENGINE_QWEN3's head size and 4 experts of width 64, top-2."""
_CORPUS = [
    "Let x be the answer. Then 3 + 4 = 7, so the answer is \\boxed{7}.",
    "<think>\nWe add the numbers.\n</think>\nThe sum of 12 and 30 is \\boxed{42}.",
    "Compute the area of a circle of radius 2: pi r^2 = 4 pi.",
]


def tiny_qwen2(seed: int):
    """The layout check's random Qwen2 (TINY_QWEN2), in memory, from `seed`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2))


def train_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on a few math sentences; id 0 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def save_tiny_qwen2(
    out: str | os.PathLike, *, seed: int = 0, end_tokens: int = 0, **overrides
) -> Path:
    """Write a random Qwen2 (TINY_ENGINE_QWEN2 with `overrides`) and the tokenizer to `out`.

    `end_tokens` > 0 adds that many ids (from 300 up) to the end token 0 in the generation
    config: a random model then ends its completions at varied lengths, as a trained model
    does, so that length rewards differ within a group and training has a signal.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save_tiny(Qwen2Config, Qwen2ForCausalLM, out, seed, end_tokens, overrides)


def save_tiny_qwen3(
    out: str | os.PathLike, *, seed: int = 0, end_tokens: int = 0, **overrides
) -> Path:
    """`save_tiny_qwen2`'s model as a Qwen3 (QK norm, no QKV bias) with TINY_ENGINE_QWEN3's
    head_dim of 64, which is not hidden / heads (32), and `overrides`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    settings = {**TINY_ENGINE_QWEN3, **overrides}
    return _save_tiny(Qwen3Config, Qwen3ForCausalLM, out, seed, end_tokens, settings)


def save_tiny_qwen3_moe(
    out: str | os.PathLike, *, seed: int = 0, end_tokens: int = 0, **overrides
) -> Path:
    """`save_tiny_qwen3`'s model as a Qwen3-MoE (TINY_ENGINE_QWEN3_MOE) with `overrides`; its
    router is drawn at std 0.5 (`perturb`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings = {**TINY_ENGINE_QWEN3_MOE, **overrides}
    return _save_tiny(Qwen3MoeConfig, Qwen3MoeForCausalLM, out, seed, end_tokens, settings)


def perturb(model) -> None:
    """Give a freshly initialised model what its init leaves too plain to test: random biases
    and norms (zeros and ones at init, so a mapping or sync that mixes them up goes unseen),
    and a MoE router at std 0.5, so that a token's top-k experts are decided by a margin (at
    the init scale of 0.02 the expert scores nearly tie, and their top-k flips on rounding
    between two exact implementations). Draws from torch's global generator."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)


def _save_tiny(config_cls, model_cls, out, seed: int, end_tokens: int, overrides: dict) -> Path:
    out = Path(out)
    config = config_cls(**{**TINY_ENGINE_QWEN2, **overrides}, architectures=[model_cls.__name__])
    torch.manual_seed(seed)
    model = model_cls(config)
    perturb(model)
    if end_tokens:
        model.generation_config.eos_token_id = [0, *range(300, 300 + end_tokens)]
    model.save_pretrained(out)
    train_tokenizer().save_pretrained(out)
    return out
