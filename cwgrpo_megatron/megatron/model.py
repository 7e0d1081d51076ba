"""A Megatron-Core GPTModel for a Qwen2 / Qwen3 / Qwen3-MoE / Llama architecture, and HF
weights loaded into it.

Settings mapped from the HF config (`ModelArch`): RMSNorm and its eps, SwiGLU, QKV bias,
Qwen3's QK norm, grouped-query attention (`num_key_value_heads` -> `num_query_groups`), head
dim, RoPE theta and Llama 3.x RoPE scaling, max positions, tied or untied embeddings, fp32 /
bf16 parameters. The vocabulary is padded to a multiple of `make_vocab_size_divisible_by x tp`;
padded logits are masked out downstream by
`vocab_parallel_logprob_entropy(..., vocab_size=arch.vocab_size)`.

Qwen3-MoE (`moe_settings`): Megatron's MoE layer with top-k routing as Qwen3 routes (softmax
in fp32 over all experts, top k, renormalised when norm_topk_prob), no shared expert, the
load-balancing loss at router_aux_loss_coef, and the all-to-all token dispatcher over the
expert-parallel group. Experts run as TE's grouped GEMM on GPU and as `SequentialMLP` (one
torch MLP per local expert) on CPU.

Layer spec: Transformer Engine's when TE and a GPU are present, Megatron's local one otherwise.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from cwgrpo_megatron.convert.arch import ModelArch, padded_vocab_size
from cwgrpo_megatron.convert.mapping import megatron_shape, stage_params, to_megatron
from cwgrpo_megatron.megatron.cpu import check_cpu_config, on_cpu

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def use_transformer_engine() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def fusion_settings(*, te: bool, tp: int = 1, moe: bool = False) -> dict[str, bool]:
    """Megatron's kernel fusions and sequence parallelism: on with Transformer Engine's layers
    (which needs a GPU), off with the local spec, where the torch layers have none of them,
    except sequence parallelism for a MoE model at tp > 1, which Megatron's MoE layer needs
    (the local spec's norms are `SequenceParallelRMSNorm`).

    - bias_activation_fusion: SwiGLU in one kernel, so a layer keeps fc1's output alone for the
      backward pass (`analysis.planner`: 3 x [n, f/tp] per layer instead of 5);
    - apply_rope_fusion: TE's fused rotary embedding;
    - gradient_accumulation_fusion: TE adds each micro-batch's weight gradient straight into
      the fp32 `main_grad`; without it the gradient is rounded to bf16 first;
    - sequence_parallel (tp > 1): the norms and the residual stream hold s/tp of the sequence
      and TP's all-reduces become all-gathers and reduce-scatters; micro-batches are padded to
      a multiple of tp (`sequence_multiple`).
    """
    sp = (te or moe) and tp > 1
    return dict(
        bias_activation_fusion=te,
        apply_rope_fusion=te,
        gradient_accumulation_fusion=te,
        sequence_parallel=sp,
    )


def sequence_multiple(model) -> int:
    """The multiple of tokens a sequence must have for `model`: tp under sequence parallelism
    (the sequence is split over the TP ranks), else 1."""
    config = unwrap(model).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def moe_settings(arch: ModelArch, *, ep: int, expert_tp: int, te: bool) -> dict:
    """TransformerConfig's MoE fields for `arch` (none for a dense model).

    Qwen3 routes with p = softmax(logits) over all E experts in fp32 and keeps the top k;
    norm_topk_prob renormalises them to sum to one, which equals a softmax over the top k
    logits, Megatron's default (`moe_router_pre_softmax=False`); without it the top k of the
    full softmax are kept as they are (`moe_router_pre_softmax=True`). The load-balancing loss
    (`aux_loss`) enters the backward pass through Megatron's MoE layer, not the policy loss.
    """
    if not arch.is_moe:
        return {}
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=te,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
    )


def transformer_config(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    expert_tp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides,
) -> TransformerConfig:
    """The TransformerConfig of `arch` at tp x pp (x ep x expert_tp for a MoE model);
    `overrides` set further fields."""
    arch.check_layout(tp=tp, pp=pp, ep=ep, expert_tp=expert_tp)
    te = use_transformer_engine()
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        **fusion_settings(te=te, tp=tp, moe=arch.is_moe),
        **moe_settings(arch, ep=ep, expert_tp=expert_tp, te=te),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    check_cpu_config(config)
    return config


class SequenceParallelRMSNorm:
    """torch's RMSNorm, as Megatron's local spec builds it (`WrappedTorchNorm`), that also runs
    under sequence parallelism: a norm is per token, so on s / tp of the sequence it is the
    same, and its weight is marked `sequence_parallel` so that Megatron sums its gradient
    over the TP ranks (`finalize_model_grads`), whose tokens differ."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(arch: ModelArch, config: TransformerConfig):
    """Megatron's spec for `arch`'s decoder: Transformer Engine's layer when it is installed,
    else the local one (torch modules) with `SequenceParallelRMSNorm` for every norm, as a
    block of this stage's layers; with Qwen3's per-head QK norm where the architecture has it
    and the MoE layer for Qwen3-MoE (TE's grouped GEMM, or the local spec's SequentialMLP)."""
    experts = arch.num_experts or None
    if use_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=experts is not None,
            qk_layernorm=arch.qk_layernorm,
        )
    spec = get_gpt_layer_local_spec(
        num_experts=experts, normalization="RMSNorm", qk_layernorm=arch.qk_layernorm
    )
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
    if arch.qk_layernorm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=SequenceParallelRMSNorm
    )


def build_model(
    arch: ModelArch,
    *,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    **config_overrides,
) -> GPTModel:
    """This rank's pipeline stage of the model (and its experts), at the parallel layout of
    `parallel_state`."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep, expert_tp = expert_layout()
    config = transformer_config(
        arch,
        tp=tp,
        pp=pp,
        ep=ep,
        expert_tp=expert_tp,
        params_dtype=params_dtype,
        **config_overrides,
    )
    with on_cpu():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(arch, config),
            vocab_size=padded_vocab_size(
                arch.vocab_size, tp=tp, divisible_by=make_vocab_size_divisible_by
            ),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            rotary_percent=1.0,
            rope_scaling=arch.rope_scaling_factor is not None,
            rope_scaling_factor=arch.rope_scaling_factor or 8.0,
            parallel_output=True,
        )
    model.vocab_size_unpadded = arch.vocab_size
    # The local spec's torch norms make their weights in torch's default dtype, fp32, whatever
    # params_dtype says (Megatron-LM casts them with its Float16Module, which we do not use). A
    # bf16 model with fp32 norms has two dtypes of parameters, and Megatron's optimizer state
    # then does not line up with the model's parameters when a checkpoint is saved.
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm):
            module.to(params_dtype)
    return model


def load_hf_weights(
    model: GPTModel, arch: ModelArch, get_tensor: Callable[[str], torch.Tensor]
) -> None:
    """Copy HF tensors (fetched one at a time by `get_tensor(name)`) into this rank's stage
    (and its experts).

    Raises ValueError naming the tensor when a shape does not match `arch`.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep, expert_tp = expert_layout()
    ep_rank, expert_tp_rank = expert_ranks()
    params = dict(model.named_parameters())
    padded = model.vocab_size
    for item in stage_params(
        arch,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep_rank=ep_rank,
        ep=ep,
        te_spec=use_transformer_engine(),
    ):
        if item.megatron_name not in params:
            raise RuntimeError(f"the Megatron model has no parameter {item.megatron_name}")
        hf = [get_tensor(n) for n in item.hf_names]
        if item.rule.expert:
            split, rank = expert_tp, expert_tp_rank
        else:
            split, rank = tp, tp_rank
        shard = to_megatron(item.rule, hf, arch, tp=split, tp_rank=rank, padded_vocab=padded)
        expected = megatron_shape(item.rule, arch, tp=split, padded_vocab=padded)
        target = params[item.megatron_name]
        if tuple(shard.shape) != expected or tuple(target.shape) != expected:
            shapes = ", ".join(
                f"{n}: {tuple(t.shape)}" for n, t in zip(item.hf_names, hf, strict=True)
            )
            raise ValueError(
                f"checkpoint shapes do not match the config for {item.megatron_name} "
                f"({shapes}); expected a shard of {expected} at tp={split}"
            )
        with torch.no_grad():
            target.copy_(shard)


def expert_layout() -> tuple[int, int]:
    """(ep, expert_tp): the expert-parallel and expert-tensor-parallel sizes of `parallel_state`."""
    return (
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )


def expert_ranks() -> tuple[int, int]:
    """(ep_rank, expert_tp_rank) of this rank."""
    return (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
