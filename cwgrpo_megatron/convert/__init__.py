"""HF <-> Megatron conversion: the architecture, one declarative name / shape mapping."""

from cwgrpo_megatron.convert.arch import ModelArch, padded_vocab_size
from cwgrpo_megatron.convert.mapping import Rule, StageParam, stage_params, to_hf, to_megatron

__all__ = [
    "ModelArch",
    "Rule",
    "StageParam",
    "padded_vocab_size",
    "stage_params",
    "to_hf",
    "to_megatron",
]
