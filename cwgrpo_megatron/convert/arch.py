"""The Qwen2 / Qwen3 / Qwen3-MoE / Llama architecture read from an HF `config.json`, and
layout checks.

Pure Python: the tools, the mapping and the Megatron model builder all start from `ModelArch`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "LlamaForCausalLM",
)
# Llama 3.x RoPE scaling as Megatron-Core implements it: only the factor is a parameter
LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
RECIPES = Path(__file__).resolve().parents[2] / "configs" / "models"
"""HF config.json facts of the models our run configs target (configs/models/NAME.json)."""


@dataclass(kw_only=True, frozen=True)
class ModelArch:
    """The fields of a decoder-only Qwen2 / Qwen3 / Qwen3-MoE / Llama block that the Megatron
    model needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_embeddings: bool
    torch_dtype: str
    rope_scaling_factor: float | None = None
    """Llama 3.x RoPE scaling (rope_type llama3) with this factor; None: plain RoPE."""
    qk_layernorm: bool = False
    """An RMSNorm over each head's query and key before RoPE (Qwen3's q_norm / k_norm, one
    weight of head_dim shared by the heads)."""
    num_experts: int = 0
    """Routed experts per layer (Qwen3-MoE's num_experts); 0: a dense MLP. Every layer is a MoE
    layer (decoder_sparse_step 1, no mlp_only_layers), with no shared expert."""
    moe_topk: int = 0
    """Experts each token is routed to (num_experts_per_tok)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's SwiGLU width (moe_intermediate_size)."""
    moe_norm_topk_prob: bool = False
    """The router's weights: softmax over all experts, then the top k, renormalised to sum to
    one when this is set (norm_topk_prob)."""
    moe_aux_loss_coeff: float = 0.0
    """The load-balancing loss's coefficient (router_aux_loss_coef)."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> ModelArch:
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing: pass the folder of a Hugging Face checkpoint")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path} is not valid JSON ({err}); re-download or re-save it"
            ) from err
        return cls.from_hf_dict(data, source=str(path))

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], *, source: str = "config") -> ModelArch:
        archs = data.get("architectures") or []
        arch = archs[0] if archs else data.get("model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in data:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return data[key]

        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            for key, value in LLAMA3_ROPE_FIXED.items():
                if float(rope.get(key, value)) != value:
                    raise ValueError(
                        f"{source}: llama3 rope scaling with {key}={rope[key]} is not supported; "
                        f"Megatron-Core fixes {key}={value}"
                    )
            if "factor" not in rope:
                raise ValueError(f"{source}: llama3 rope scaling has no 'factor'")
            scaling = float(rope["factor"])
        elif rope_type not in ("default", None):
            raise ValueError(
                f"{source}: rope type {rope_type!r} is not supported (default or llama3)"
            )
        if data.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported")
        if data.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {data['hidden_act']!r} is not supported (silu)")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        kv_heads = int(data.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        rope_theta = data.get("rope_theta", rope.get("rope_theta", 10000.0))
        moe = _moe_fields(data, source) if arch == "Qwen3MoeForCausalLM" else {}
        # Qwen2 always has the QKV bias (its config has no switch); Qwen3 and Llama as configured
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(data.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            ffn_hidden_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(data.get("head_dim") or hidden // heads),
            max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            qkv_bias=qkv_bias,
            tie_embeddings=bool(data.get("tie_word_embeddings", False)),
            torch_dtype=str(data.get("torch_dtype") or data.get("dtype") or "float32"),
            rope_scaling_factor=scaling,
            qk_layernorm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            **moe,
        )

    @classmethod
    def recipe(cls, name_or_path: str) -> ModelArch:
        """A model of configs/models by name (e.g. qwen2p5_math_7b), or an HF config.json /
        checkpoint folder by path."""
        path = Path(name_or_path)
        if path.is_dir():
            return cls.from_hf_dir(path)
        if path.suffix == ".json" and path.is_file():
            return cls.from_hf_dict(json.loads(path.read_text()), source=str(path))
        known = recipe_names()
        if name_or_path not in known:
            raise ValueError(
                f"unknown model {name_or_path!r}: name one of {', '.join(known)}, or give the "
                "path of an HF config.json or checkpoint folder"
            )
        return cls.from_hf_dict(
            json.loads((RECIPES / f"{name_or_path}.json").read_text()), source=name_or_path
        )

    def differences(self, other: ModelArch) -> list[str]:
        """`field: ours vs theirs` for every architecture field that differs (dtype aside)."""
        return [
            f"{k}: {v!r} vs {getattr(other, k)!r}"
            for k, v in self.to_dict().items()
            if k != "torch_dtype" and getattr(other, k) != v
        ]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_layout(self, *, tp: int, pp: int, ep: int = 1, expert_tp: int = 1) -> None:
        """Raise ValueError, naming the largest valid value and listing the valid ones, if tp /
        pp / ep / expert_tp cannot split the model."""
        if min(tp, pp, ep, expert_tp) < 1:
            raise ValueError(
                f"tp, pp, ep and expert_tp must be >= 1, got tp={tp} pp={pp} ep={ep} "
                f"expert_tp={expert_tp}"
            )
        self._check_experts(ep=ep, expert_tp=expert_tp)
        # a MoE model has no dense MLP for tp to split: its experts are split by expert_tp
        shared = math.gcd(
            math.gcd(self.num_heads, self.num_kv_heads), 0 if self.is_moe else self.ffn_hidden_size
        )
        valid_tp = f"; valid tp: {', '.join(map(str, divisors(shared)))}"
        for what, count in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
        ):
            if count % tp:
                best = max(
                    d
                    for d in range(1, tp + 1)
                    if self.num_heads % d == 0 and self.num_kv_heads % d == 0
                )
                raise ValueError(
                    f"tp={tp} does not divide {what}={count}; the largest valid tp "
                    f"at or below {tp} is {best}{valid_tp}"
                )
        if not self.is_moe and self.ffn_hidden_size % tp:
            raise ValueError(
                f"tp={tp} does not divide intermediate_size={self.ffn_hidden_size}{valid_tp}"
            )
        if self.num_layers % pp:
            best = max(d for d in range(1, pp + 1) if self.num_layers % d == 0)
            raise ValueError(
                f"pp={pp} does not divide num_hidden_layers={self.num_layers}; the largest "
                f"valid pp at or below {pp} is {best}; valid pp: "
                + ", ".join(map(str, divisors(self.num_layers)))
            )

    def _check_experts(self, *, ep: int, expert_tp: int) -> None:
        if not self.is_moe:
            if ep > 1 or expert_tp > 1:
                raise ValueError(
                    f"ep={ep} and expert_tp={expert_tp} split experts, and {self.architecture} "
                    "is a dense model: set parallel.ep=1 and parallel.expert_tp=1"
                )
            return
        if self.num_experts % ep:
            raise ValueError(
                f"ep={ep} does not divide num_experts={self.num_experts}; valid ep: "
                + ", ".join(map(str, divisors(self.num_experts)))
            )
        if self.moe_ffn_hidden_size % expert_tp:
            raise ValueError(
                f"expert_tp={expert_tp} does not divide moe_intermediate_size="
                f"{self.moe_ffn_hidden_size}; valid expert_tp: "
                + ", ".join(map(str, divisors(self.moe_ffn_hidden_size)))
            )


def _moe_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelArch's MoE fields from a Qwen3-MoE config; ValueError for the variants that the
    Megatron model does not build (dense layers among the MoE ones)."""
    # the hub's configs say num_experts; transformers 5 writes num_local_experts
    data = {"num_experts": data.get("num_experts") or data.get("num_local_experts"), **data}
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not data.get(key):
            raise ValueError(f"{source}: required MoE field {key!r} is missing or zero")
    if int(data.get("decoder_sparse_step", 1)) != 1 or data.get("mlp_only_layers"):
        raise ValueError(
            f"{source}: dense layers among the MoE ones (decoder_sparse_step="
            f"{data.get('decoder_sparse_step', 1)}, mlp_only_layers="
            f"{data.get('mlp_only_layers')}) are not supported: every layer must be a MoE layer"
        )
    experts, topk = int(data["num_experts"]), int(data["num_experts_per_tok"])
    if not 1 <= topk <= experts:
        raise ValueError(f"{source}: num_experts_per_tok={topk} is not in 1..{experts}")
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=int(data["moe_intermediate_size"]),
        moe_norm_topk_prob=bool(data.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(data.get("router_aux_loss_coef", 0.0)),
    )


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.json"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def padded_vocab_size(vocab_size: int, *, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary padded to a multiple of divisible_by x tp (Megatron's convention)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
