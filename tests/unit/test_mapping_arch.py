"""The HF <-> Megatron mapping of names and shapes (`convert/`): the architecture read from a
config and its errors, layout checks that name the largest valid tp / pp, vocabulary padding,
split-and-merge round trips of every rule at TP1 and TP2, the per-query-group QKV layout, and
stage parameters that cover the model once."""

import pytest
import torch

from cwgrpo_megatron.checks.tiny import TINY_QWEN2
from cwgrpo_megatron.convert.arch import ModelArch, padded_vocab_size
from cwgrpo_megatron.convert.mapping import (
    Rule,
    hf_names,
    hf_shapes,
    layer_offset,
    megatron_shape,
    shard_pieces,
    stage_params,
    to_hf,
    to_megatron,
)

# the layout check's Qwen2, with 8 query heads (4 per KV head)
HF = dict(
    TINY_QWEN2,
    num_attention_heads=8,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=128,
)
ARCH = ModelArch.from_hf_dict(HF)


def test_arch_fields():
    assert ARCH.head_dim == 8 and ARCH.heads_per_group == 4 and ARCH.qkv_bias
    llama = ModelArch.from_hf_dict({**HF, "architectures": ["LlamaForCausalLM"]})
    assert not llama.qkv_bias
    v5 = {k: v for k, v in HF.items() if k != "rope_theta"}
    v5["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    assert ModelArch.from_hf_dict(v5).rope_theta == 5e5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "'MistralForCausalLM' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope type 'yarn' is not supported"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_arch_rejects_unsupported(change, message):
    data = {**HF, **change}
    if change.get("hidden_size", 0) is None:
        del data["hidden_size"]
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_dict(data)


def test_layout_errors_name_the_largest_valid_value():
    ARCH.check_layout(tp=2, pp=4)
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2; the largest"):
        ARCH.check_layout(tp=4, pp=1)
    with pytest.raises(ValueError, match="pp=3 does not divide num_hidden_layers=4.* is 2"):
        ARCH.check_layout(tp=1, pp=3)


def test_padded_vocab():
    assert padded_vocab_size(1000, tp=1) == 1024
    assert padded_vocab_size(151936, tp=1) == 151936
    assert padded_vocab_size(151936, tp=2) == 152064
    assert padded_vocab_size(1000, tp=8) == 1024


def _hf_tensors(gen):
    h, hd = ARCH.hidden_size, ARCH.head_dim
    q = torch.randn(ARCH.num_heads * hd, h, generator=gen)
    k = torch.randn(ARCH.num_kv_heads * hd, h, generator=gen)
    v = torch.randn(ARCH.num_kv_heads * hd, h, generator=gen)
    return q, k, v


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "vocab", "row", "col", "replicated"])
def test_split_and_merge_round_trip(kind, tp):
    gen = torch.Generator().manual_seed(0)
    h = ARCH.hidden_size
    if kind == "qkv":
        rule, hf = Rule("x.linear_qkv.weight", ("q", "k", "v"), "qkv", 0), _hf_tensors(gen)
    elif kind == "gate_up":
        hf = (torch.randn(96, h, generator=gen), torch.randn(96, h, generator=gen))
        rule = Rule("x.linear_fc1.weight", ("g", "u"), "gate_up", 0)
    elif kind == "vocab":
        rule, hf = Rule("embedding", ("e",), "vocab", 0), (torch.randn(1000, h, generator=gen),)
    elif kind == "row":
        rule, hf = Rule("x.linear_fc2.weight", ("d",), "copy", 1), (torch.randn(h, 96),)
    elif kind == "col":
        rule, hf = Rule("y", ("d",), "copy", 0), (torch.randn(96, h),)
    else:
        rule, hf = Rule("norm", ("n",), "copy", None), (torch.randn(h),)
    padded = padded_vocab_size(1000, tp=tp)
    shards = [to_megatron(rule, hf, ARCH, tp=tp, tp_rank=r, padded_vocab=padded) for r in range(tp)]
    back = to_hf(rule, shards, ARCH)
    assert len(back) == len(hf)
    for a, b in zip(hf, back, strict=True):
        assert torch.equal(a, b)
    # each rank places its own shard, without the others': every element exactly once
    placed = [torch.full_like(t, float("nan")) for t in hf]
    writes = [torch.zeros_like(t) for t in hf]
    for r, shard in enumerate(shards):
        for index, where, values in shard_pieces(rule, shard, ARCH, tp=tp, tp_rank=r):
            placed[index][where] = values
            writes[index][where] += 1
    for a, b, w in zip(hf, placed, writes, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(w, torch.ones_like(w))


def test_qkv_fusion_layout_is_per_query_group():
    hd, per_group = ARCH.head_dim, ARCH.heads_per_group
    q = torch.arange(ARCH.num_heads).repeat_interleave(hd)[:, None].float()  # head index
    k = 100 + torch.arange(ARCH.num_kv_heads).repeat_interleave(hd)[:, None].float()
    v = 200 + torch.arange(ARCH.num_kv_heads).repeat_interleave(hd)[:, None].float()
    rule = Rule("qkv.bias", ("q", "k", "v"), "qkv", 0)
    fused = to_megatron(rule, (q, k, v), ARCH)[:, 0]
    rows = fused.reshape(ARCH.num_kv_heads, (per_group + 2), hd)[:, :, 0]
    assert rows.tolist() == [[0, 1, 2, 3, 100, 200], [4, 5, 6, 7, 101, 201]]
    # TP rank 1 of 2 holds the second query group whole
    second = to_megatron(rule, (q, k, v), ARCH, tp=2, tp_rank=1)[:, 0]
    assert second.reshape(per_group + 2, hd)[:, 0].tolist() == [4, 5, 6, 7, 101, 201]


def test_gate_up_shards_hold_matching_halves():
    gate = torch.zeros(96, 4)
    up = torch.ones(96, 4)
    rule = Rule("fc1", ("g", "u"), "gate_up", 0)
    shard = to_megatron(rule, (gate, up), ARCH, tp=2, tp_rank=0)
    assert shard.shape == (96, 4)
    assert torch.equal(shard[:48], gate[:48]) and torch.equal(shard[48:], up[:48])


@pytest.mark.parametrize("te_spec", [False, True], ids=["local", "te"])
def test_stage_params_cover_the_model_once(te_spec):
    tied = ModelArch.from_hf_dict({**HF, "tie_word_embeddings": True})
    for arch in (ARCH, tied):
        for pp in (1, 2, 4):
            seen = []
            for rank in range(pp):
                params = stage_params(arch, pp_rank=rank, pp=pp, te_spec=te_spec)
                seen += [n for p in params for n in p.hf_names]
            expected = set(hf_names(arch))
            assert set(seen) == expected
            if not (arch.tie_embeddings and pp > 1):
                assert len(seen) == len(expected), "an HF tensor was used twice"
    assert layer_offset(1, num_layers=4, pp=2) == 2
    last = list(stage_params(ARCH, pp_rank=1, pp=2, te_spec=te_spec))
    assert last[0].megatron_name.startswith("decoder.layers.0.")
    assert last[0].hf_names[0].startswith("model.layers.2.")


def test_megatron_shapes():
    padded = padded_vocab_size(1000, tp=2)
    shapes = {
        p.megatron_name: megatron_shape(p.rule, ARCH, tp=2, padded_vocab=padded)
        for p in stage_params(ARCH, te_spec=False)
    }
    assert shapes["embedding.word_embeddings.weight"] == (512, 64)
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == (48, 64)
    assert shapes["decoder.layers.0.self_attention.linear_qkv.bias"] == (48,)
    assert shapes["decoder.layers.0.self_attention.linear_proj.weight"] == (64, 32)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (96, 64)
    assert shapes["decoder.layers.0.mlp.linear_fc2.weight"] == (64, 48)
    assert shapes["decoder.final_layernorm.weight"] == (64,)


# a Qwen3-MoE config as the hub writes it (num_experts), 8 experts of width 48, top-2
MOE_HF = dict(
    HF,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    head_dim=16,
)
MOE = ModelArch.from_hf_dict(MOE_HF)


def test_moe_arch_fields():
    assert MOE.is_moe and not ARCH.is_moe
    assert (MOE.num_experts, MOE.moe_topk, MOE.moe_ffn_hidden_size) == (8, 2, 48)
    assert MOE.moe_norm_topk_prob and MOE.moe_aux_loss_coeff == 0.001
    assert MOE.qk_layernorm and not MOE.qkv_bias
    # transformers 5 writes the expert count as num_local_experts
    v5 = {k: v for k, v in MOE_HF.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert ModelArch.from_hf_dict(v5) == MOE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mlp_only_layers": [0]}, "every layer must be a MoE layer"),
        ({"decoder_sparse_step": 2}, "every layer must be a MoE layer"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is not in 1..8"),
        ({"moe_intermediate_size": 0}, "'moe_intermediate_size' is missing or zero"),
    ],
)
def test_moe_arch_rejects_unsupported(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_dict({**MOE_HF, **change})


@pytest.mark.parametrize(
    ("arch", "layout", "message"),
    [
        (MOE, dict(tp=1, pp=1, ep=3), r"ep=3 does not divide num_experts=8; valid ep: 1, 2, 4, 8"),
        (MOE, dict(tp=1, pp=1, expert_tp=5), "expert_tp=5 does not divide moe_intermediate_size"),
        (ARCH, dict(tp=1, pp=1, ep=2), "is a dense model: set parallel.ep=1"),
    ],
)
def test_expert_layout_errors_name_the_fix(arch, layout, message):
    with pytest.raises(ValueError, match=message):
        arch.check_layout(**layout)


@pytest.mark.parametrize("te_spec", [False, True])
@pytest.mark.parametrize(("pp", "ep"), [(1, 1), (2, 2), (1, 4)])
def test_expert_parameters_cover_every_expert_once(te_spec, pp, ep):
    seen: dict[str, int] = {}
    for stage in range(pp):
        for ep_rank in range(ep):
            for p in stage_params(
                MOE, pp_rank=stage, pp=pp, ep_rank=ep_rank, ep=ep, te_spec=te_spec
            ):
                if p.rule.expert:
                    for name in p.hf_names:
                        seen[name] = seen.get(name, 0) + 1
                    # the Megatron name counts the rank's own experts from 0
                    local = int(p.hf_names[0].split(".experts.")[1].split(".")[0]) % (8 // ep)
                    assert (f"weight{local}" if te_spec else f"local_experts.{local}.") in (
                        p.megatron_name
                    )
    experts = {n for n in hf_names(MOE) if ".experts." in n}
    assert len(experts) == 4 * 8 * 3 and set(seen) == experts
    assert set(seen.values()) == {1}


@pytest.mark.parametrize("expert_tp", [1, 2])
def test_expert_rules_round_trip(expert_tp):
    gen = torch.Generator().manual_seed(0)
    for item in stage_params(MOE, te_spec=False):
        if not item.rule.expert and "router" not in item.megatron_name:
            continue
        shapes = hf_shapes(MOE)
        hf = [torch.randn(shapes[n], generator=gen) for n in item.hf_names]
        split = expert_tp if item.rule.expert else 1
        shards = [
            to_megatron(item.rule, hf, MOE, tp=split, tp_rank=r, padded_vocab=0)
            for r in range(split)
        ]
        expected = megatron_shape(item.rule, MOE, tp=split, padded_vocab=0)
        assert all(tuple(s.shape) == expected for s in shards), item.megatron_name
        for a, b in zip(hf, to_hf(item.rule, shards, MOE), strict=True):
            assert torch.equal(a, b), item.megatron_name
        placed = [torch.full_like(t, float("nan")) for t in hf]
        for r, shard in enumerate(shards):
            for index, where, values in shard_pieces(item.rule, shard, MOE, tp=split, tp_rank=r):
                placed[index][where] = values
        for a, b in zip(hf, placed, strict=True):
            assert torch.equal(a, b), item.megatron_name
