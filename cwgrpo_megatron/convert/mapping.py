"""One declarative HF <-> Megatron mapping of names and shapes for Qwen2 / Qwen3 / Qwen3-MoE /
Llama.

Used by the checkpoint tools and by weight sync. Each `Rule` ties one Megatron parameter to the
Hugging Face tensor(s) it is made of and says how it is laid out over tensor parallelism:

    kind     Megatron tensor (full, tp = 1)                      TP split (rank r of tp)
    copy     the HF tensor as is                                  dim `tp_dim`, or replicated
    qkv      per query group g: [q heads of g; k_g; v_g]          dim 0, whole query groups
             -> [groups * (heads_per_group + 2) * head_dim, ...]
    gate_up  [gate; up] -> [2 * ffn, hidden]                      [gate_r; up_r] on each rank
    vocab    rows padded with zeros to the padded vocabulary      dim 0, then unpadded on export

Layer indices: HF names use the global layer index; a Megatron pipeline stage names its layers
from 0, offset by `layer_offset`. Norm names differ with the Transformer Engine layer spec,
which fuses the norms into the following linear layer.

Experts (Qwen3-MoE): a MoE layer has a router `[E, hidden]`, replicated, and E experts, each a
SwiGLU of width `moe_ffn_hidden_size` mapped like the dense MLP (gate_up, and a copy split on
dim 1). An expert rule (`Rule.expert`) names one expert: `{expert}` is the rank's local index
in the Megatron name (`local_experts.{expert}` with the local spec's SequentialMLP,
`weight{expert}` with TE's grouped GEMM) and the global one in the HF name
(`mlp.experts.{expert}.gate_proj.weight`, how checkpoints store them); expert-parallel rank e
of ep holds experts e E/ep .. (e+1) E/ep - 1, and its TP split is over the expert-tensor-parallel
group (expert_tp), not tp. The pre-MLP norm of a MoE layer is a norm of its own in both specs
(TE fuses it into linear_fc1 only for a dense MLP).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cwgrpo_megatron.convert.arch import ModelArch

KINDS = ("copy", "qkv", "gate_up", "vocab")


@dataclass(frozen=True)
class Rule:
    megatron: str
    """Megatron parameter name; `{layer}` is the stage-local layer index."""
    hf: tuple[str, ...]
    """HF tensor names; `{layer}` is the global layer index."""
    kind: str
    tp_dim: int | None
    """Dimension split over tensor parallelism; None when replicated."""
    expert: bool = False
    """One expert's parameter: `{expert}` in the names, split over expert_tp."""


def _mlp_rules(arch: ModelArch, *, te_spec: bool) -> list[Rule]:
    """The dense MLP's rules, or a MoE layer's router and experts."""
    mlp, hf_mlp = "decoder.layers.{layer}.mlp", "model.layers.{layer}.mlp"
    if not arch.is_moe:
        return [
            Rule(
                f"{mlp}.linear_fc1.weight",
                (f"{hf_mlp}.gate_proj.weight", f"{hf_mlp}.up_proj.weight"),
                "gate_up",
                0,
            ),
            Rule(f"{mlp}.linear_fc2.weight", (f"{hf_mlp}.down_proj.weight",), "copy", 1),
        ]
    hf_expert = f"{hf_mlp}.experts.{{expert}}"
    fc1, fc2 = (
        (f"{mlp}.experts.linear_fc{i}.weight{{expert}}" for i in (1, 2))
        if te_spec
        else (f"{mlp}.experts.local_experts.{{expert}}.linear_fc{i}.weight" for i in (1, 2))
    )
    return [
        Rule(f"{mlp}.router.weight", (f"{hf_mlp}.gate.weight",), "copy", None),
        Rule(
            fc1,
            (f"{hf_expert}.gate_proj.weight", f"{hf_expert}.up_proj.weight"),
            "gate_up",
            0,
            expert=True,
        ),
        Rule(fc2, (f"{hf_expert}.down_proj.weight",), "copy", 1, expert=True),
    ]


def layer_rules(arch: ModelArch, *, te_spec: bool) -> list[Rule]:
    attn, mlp = "decoder.layers.{layer}.self_attention", "decoder.layers.{layer}.mlp"
    hf_attn = "model.layers.{layer}.self_attn"
    qkv_names = tuple(f"{hf_attn}.{p}_proj.weight" for p in "qkv")
    rules = [
        Rule(f"{attn}.linear_qkv.weight", qkv_names, "qkv", 0),
        Rule(f"{attn}.linear_proj.weight", (f"{hf_attn}.o_proj.weight",), "copy", 1),
        *_mlp_rules(arch, te_spec=te_spec),
    ]
    if arch.qkv_bias:
        bias_names = tuple(f"{hf_attn}.{p}_proj.bias" for p in "qkv")
        rules.append(Rule(f"{attn}.linear_qkv.bias", bias_names, "qkv", 0))
    if arch.qk_layernorm:  # [head_dim], the same on every rank (and in both specs)
        rules.append(
            Rule(f"{attn}.q_layernorm.weight", (f"{hf_attn}.q_norm.weight",), "copy", None)
        )
        rules.append(
            Rule(f"{attn}.k_layernorm.weight", (f"{hf_attn}.k_norm.weight",), "copy", None)
        )
    input_norm = (
        f"{attn}.linear_qkv.layer_norm_weight"
        if te_spec
        else "decoder.layers.{layer}.input_layernorm.weight"
    )
    mlp_norm = (
        f"{mlp}.linear_fc1.layer_norm_weight"
        if te_spec and not arch.is_moe
        else "decoder.layers.{layer}.pre_mlp_layernorm.weight"
    )
    rules.append(Rule(input_norm, ("model.layers.{layer}.input_layernorm.weight",), "copy", None))
    rules.append(
        Rule(mlp_norm, ("model.layers.{layer}.post_attention_layernorm.weight",), "copy", None)
    )
    return rules


def embedding_rule() -> Rule:
    return Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)


def output_rule(arch: ModelArch) -> Rule:
    # A tied HF checkpoint has no lm_head: the last stage's output layer copies the embedding.
    source = "model.embed_tokens.weight" if arch.tie_embeddings else "lm_head.weight"
    return Rule("output_layer.weight", (source,), "vocab", 0)


def final_norm_rule() -> Rule:
    return Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None)


def layer_offset(pp_rank: int, *, num_layers: int, pp: int) -> int:
    return pp_rank * (num_layers // pp)


@dataclass(frozen=True)
class StageParam:
    megatron_name: str
    hf_names: tuple[str, ...]
    rule: Rule


def stage_params(
    arch: ModelArch, *, pp_rank: int = 0, pp: int = 1, ep_rank: int = 0, ep: int = 1, te_spec: bool
) -> Iterator[StageParam]:
    """Every Megatron parameter of pipeline stage `pp_rank` and expert-parallel rank `ep_rank`
    (its experts only), with the HF tensors it maps to. `te_spec`: the model is built with
    Transformer Engine's layers, whose norms are fused into the next linear layer
    (`linear_qkv.layer_norm_weight`); there is no default, so that no caller can name a TE
    model's parameters as the local spec's.

    The output layer appears on the last stage unless the embeddings are tied with pp == 1
    (then Megatron shares the embedding weight and has no separate output parameter).
    """
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        rule = embedding_rule()
        yield StageParam(rule.megatron, rule.hf, rule)
    per_stage = arch.num_layers // pp
    offset = layer_offset(pp_rank, num_layers=arch.num_layers, pp=pp)
    local_experts = arch.num_experts // ep
    for local in range(per_stage):
        for rule in layer_rules(arch, te_spec=te_spec):
            for e in range(local_experts) if rule.expert else (None,):
                expert = {} if e is None else {"expert": e}
                hf_expert = {} if e is None else {"expert": ep_rank * local_experts + e}
                yield StageParam(
                    rule.megatron.format(layer=local, **expert),
                    tuple(n.format(layer=local + offset, **hf_expert) for n in rule.hf),
                    rule,
                )
    if last:
        rule = final_norm_rule()
        yield StageParam(rule.megatron, rule.hf, rule)
        if not (arch.tie_embeddings and pp == 1):
            rule = output_rule(arch)
            yield StageParam(rule.megatron, rule.hf, rule)


def hf_names(arch: ModelArch) -> list[str]:
    """The HF tensor names of the whole model, in a stable order."""
    names: list[str] = []
    for param in stage_params(arch, pp=1, te_spec=False):  # HF names do not depend on the spec
        names += [n for n in param.hf_names if n not in names]
    if not arch.tie_embeddings and "lm_head.weight" not in names:
        names.append("lm_head.weight")
    return names


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of the model (what a weight update must deliver)."""
    h, hd, ffn, vocab = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.vocab_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    per_layer = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if arch.is_moe:
        per_layer["mlp.gate.weight"] = (arch.num_experts, h)
        f = arch.moe_ffn_hidden_size
        for e in range(arch.num_experts):
            per_layer.update(
                {
                    f"mlp.experts.{e}.gate_proj.weight": (f, h),
                    f"mlp.experts.{e}.up_proj.weight": (f, h),
                    f"mlp.experts.{e}.down_proj.weight": (h, f),
                }
            )
    else:
        per_layer.update(
            {
                "mlp.gate_proj.weight": (ffn, h),
                "mlp.up_proj.weight": (ffn, h),
                "mlp.down_proj.weight": (h, ffn),
            }
        )
    if arch.qkv_bias:
        per_layer.update(
            {
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,),
            }
        )
    if arch.qk_layernorm:
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for layer in range(arch.num_layers):
        shapes.update({f"model.layers.{layer}.{k}": v for k, v in per_layer.items()})
    if not arch.tie_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


# ---- shapes: HF tensors -> one Megatron shard, and all shards -> HF tensors ----------------


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: ModelArch) -> Tensor:
    groups, per_group, hd = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    rest = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, per_group * hd, *rest),
            k.reshape(groups, hd, *rest),
            v.reshape(groups, hd, *rest),
        ],
        dim=1,
    )
    return fused.reshape(groups * (per_group + 2) * hd, *rest)


def _split_qkv(fused: Tensor, arch: ModelArch, *, groups: int | None = None) -> list[Tensor]:
    """[q; k; v] of a fused QKV tensor holding `groups` query groups (default: all of them)."""
    groups = arch.num_kv_heads if groups is None else groups
    per_group, hd = arch.heads_per_group, arch.head_dim
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [per_group * hd, hd, hd], dim=1)
    return [
        q.reshape(groups * per_group * hd, *rest).contiguous(),
        k.reshape(groups * hd, *rest).contiguous(),
        v.reshape(groups * hd, *rest).contiguous(),
    ]


def to_megatron(
    rule: Rule,
    hf: Sequence[Tensor],
    arch: ModelArch,
    *,
    tp: int = 1,
    tp_rank: int = 0,
    padded_vocab: int | None = None,
) -> Tensor:
    """This TP rank's Megatron shard of `rule`'s parameter, from the full HF tensors."""
    if rule.kind == "gate_up":
        gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    if rule.kind == "qkv":
        full = _fuse_qkv(*hf, arch)
    elif rule.kind == "vocab":
        (full,) = hf
        rows = padded_vocab or full.shape[0]
        if rows < full.shape[0]:
            raise ValueError(f"padded vocab {rows} is smaller than the vocab {full.shape[0]}")
        if rows > full.shape[0]:
            pad = full.new_zeros(rows - full.shape[0], *full.shape[1:])
            full = torch.cat([full, pad], dim=0)
    else:
        (full,) = hf
    if rule.tp_dim is None or tp == 1:
        return full.contiguous()
    return full.chunk(tp, dim=rule.tp_dim)[tp_rank].contiguous()


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    """torch.cat, but one part is returned as is (a view, not a copy: export streams views)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def to_hf(rule: Rule, shards: Sequence[Tensor], arch: ModelArch) -> list[Tensor]:
    """The full HF tensor(s) of `rule`, from every TP rank's shard in rank order.

    With one shard the results are views of it where the layout allows (copy, gate_up, vocab).
    """
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_cat([h[0] for h in halves], 0), _cat([h[1] for h in halves], 0)]
    full = shards[0] if rule.tp_dim is None else _cat(list(shards), rule.tp_dim)
    if rule.kind == "qkv":
        return _split_qkv(full, arch)
    if rule.kind == "vocab":
        return [full[: arch.vocab_size].contiguous()]
    return [full]


Piece = tuple[int, tuple[slice, ...], Tensor]
"""(index into `rule.hf`, where in that HF tensor, the values there)."""


def shard_pieces(
    rule: Rule, shard: Tensor, arch: ModelArch, *, tp: int = 1, tp_rank: int = 0
) -> list[Piece]:
    """Where TP rank `tp_rank`'s shard of `rule`'s parameter lands in the full HF tensors,
    without gathering the other shards: the inverse of `to_megatron`, one rank at a time.

    Over the ranks of a TP group the pieces cover every HF element exactly once: a replicated
    parameter is placed by rank 0 only, and vocabulary padding rows are dropped. The values are
    views of `shard` (the QKV split copies).
    """
    if rule.tp_dim is None:
        return [(0, (), shard)] if tp_rank == 0 else []

    def rows(length: int) -> slice:  # this rank's rows of a tensor of `length` rows split by tp
        per = length // tp
        return slice(tp_rank * per, (tp_rank + 1) * per)

    if rule.kind == "gate_up":
        gate, up = shard.chunk(2, dim=0)
        where = (rows(gate.shape[0] * tp),)  # the dense MLP's or an expert's width
        return [(0, where, gate), (1, where, up)]
    if rule.kind == "qkv":
        q, k, v = _split_qkv(shard, arch, groups=arch.num_kv_heads // tp)
        q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return [(0, (rows(q_rows),), q), (1, (rows(kv_rows),), k), (2, (rows(kv_rows),), v)]
    if rule.kind == "vocab":
        start = tp_rank * shard.shape[0]
        real = min(shard.shape[0], arch.vocab_size - start)  # the rest is padding
        return [(0, (slice(start, start + real),), shard[:real])] if real > 0 else []
    width = shard.shape[rule.tp_dim]
    where = (slice(None),) * rule.tp_dim + (slice(tp_rank * width, (tp_rank + 1) * width),)
    return [(0, where, shard)]


def megatron_shape(rule: Rule, arch: ModelArch, *, tp: int, padded_vocab: int) -> tuple:
    """The shape of one TP rank's shard, for checking a checkpoint against the config; for an
    expert rule `tp` is the expert-tensor-parallel size."""
    h, hd = arch.hidden_size, arch.head_dim
    if rule.expert:
        f = arch.moe_ffn_hidden_size // tp
        return (2 * f, h) if rule.kind == "gate_up" else (h, f)
    if rule.megatron.endswith("router.weight"):
        return (arch.num_experts, h)
    qkv_rows = arch.num_kv_heads * (arch.heads_per_group + 2) * hd // tp
    name = rule.megatron
    if rule.kind == "vocab":
        return (padded_vocab // tp, h)
    if rule.kind == "qkv":
        return (qkv_rows, h) if name.endswith("weight") else (qkv_rows,)
    if rule.kind == "gate_up":
        return (2 * arch.ffn_hidden_size // tp, h)
    if "linear_proj" in name:
        return (h, arch.num_heads * hd // tp)
    if "linear_fc2" in name:
        return (h, arch.ffn_hidden_size // tp)
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return (hd,)
    return (h,)
