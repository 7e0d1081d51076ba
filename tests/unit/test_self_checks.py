"""Parts of the self-checks: the layout check's verdict (`layout_verdict`), exact on hand-made
results; its calibration's channel permutation (`checks.symmetry`), the same function with
other fp32 rounding; `--num-layers`' checkpoint truncation (`checks.truncate`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cwgrpo_megatron.checks import layout_verdict as lv
from cwgrpo_megatron.checks.symmetry import ChannelPermutation
from cwgrpo_megatron.checks.tiny import TINY_QWEN2
from cwgrpo_megatron.convert.arch import ModelArch


def result(loss, grad_norm, update):
    return {"loss": loss, "grad_norm": grad_norm, "update": update, "layout": {"tp": 1}}


REF = result([0.5, -0.25], [2.0, 4.0], {"a": [1.0, 2.0], "b": [-3.0, 0.5]})


def test_differences_are_the_worst_case_of_each_quantity():
    run = result([0.5 + 1e-6, -0.25 - 3e-6], [2.002, 4.0], {"a": [1.1, 2.0], "b": [-3.0, 0.5]})
    d = lv.differences(run, REF)
    assert d["loss"] == pytest.approx(3e-6, rel=1e-9)
    assert d["grad_norm"] == pytest.approx(1e-3, rel=1e-9)  # 0.002 / 2.0
    assert d["update"] == pytest.approx(0.05, rel=1e-9)  # 0.1 / |d_a| = 2.0


def test_noise_is_the_worst_calibration_run_with_a_floor_of_one_rounding():
    same = result(REF["loss"], REF["grad_norm"], REF["update"])
    off = result([0.5, -0.25 + 2e-7], [2.0, 4.0 * (1 + 1e-6)], REF["update"])
    noise = lv.noise(REF, [same, off])
    assert noise["loss"] == pytest.approx(2e-7, rel=1e-6)
    assert noise["grad_norm"] == pytest.approx(1e-6, rel=1e-6)
    assert noise["update"] == lv.FLOOR  # both runs equal the reference there
    assert lv.noise(REF, [same])["loss"] == lv.FLOOR * 0.5  # scale: max |ref loss|


def test_verdict_passes_within_factor_times_noise_and_fails_above_or_on_nan():
    ref = {**REF, "noise": {"loss": 1e-6, "grad_norm": 1e-6, "update": 1e-5}}
    inside = result([0.5 + 9e-6, -0.25], [2.0, 4.0], REF["update"])
    passed, rows = lv.verdict(inside, ref)
    assert passed and [r["quantity"] for r in rows] == list(lv.QUANTITIES)
    assert rows[0]["ratio"] == pytest.approx(9.0, rel=1e-6) and rows[0]["tol"] == pytest.approx(
        1e-5
    )
    outside = result([0.5 + 2e-5, -0.25], [2.0, 4.0], REF["update"])
    assert not lv.verdict(outside, ref)[0]
    broken = result([0.5, math.nan], [2.0, 4.0], REF["update"])
    passed, rows = lv.verdict(broken, ref)
    assert not passed and rows[0]["diff"] == math.inf
    with pytest.raises(ValueError, match="--calibrate"):
        lv.verdict(inside, REF)
    with pytest.raises(ValueError, match="same --steps"):
        lv.differences(result([0.5], [2.0], REF["update"]), REF)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **dict(
            TINY_QWEN2,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=128,
            architectures=["LlamaForCausalLM"],
        )
    )
    return LlamaForCausalLM(cfg).eval()


def test_the_channel_permutation_keeps_the_function_and_changes_the_rounding():
    model = tiny_llama()
    arch = ModelArch.from_hf_dict(model.config.to_dict())
    perm = ChannelPermutation(arch, seed=1)
    state = model.state_dict()
    permuted = {n: perm.apply(n, t) for n, t in state.items()}
    changed = [n for n in state if not torch.equal(permuted[n], state[n])]
    # q, k, v, o, gate, up, down per layer, the embedding and the output layer: all but norms
    assert len(changed) == 2 * 7 + 2
    assert all(torch.equal(perm.invert(n, permuted[n]), state[n]) for n in state)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens).logits
        model.load_state_dict(permuted)
        after = model(perm.tokens(tokens)).logits
    after = perm.invert("lm_head.weight", after.transpose(0, 2)).transpose(0, 2)  # vocab back
    assert torch.allclose(before, after, atol=1e-5, rtol=0)
    assert not torch.equal(before, after)  # other reduction orders: not bit-identical


def test_truncate_keeps_the_first_layers_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from cwgrpo_megatron.checks import truncate
    from cwgrpo_megatron.checks.truncate import truncate_checkpoint

    model = tiny_llama()
    model.save_pretrained(tmp_path / "full")
    out = truncate_checkpoint(tmp_path / "full", 1, tmp_path / "first1")
    short = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert short.config.num_hidden_layers == 1
    full, kept = model.state_dict(), short.state_dict()
    assert set(kept) == {n for n in full if not n.startswith("model.layers.1.")}
    assert all(torch.equal(kept[n], full[n]) for n in kept)
    with pytest.raises(ValueError, match="has layers 1..2"):
        truncate_checkpoint(tmp_path / "full", 3, tmp_path / "bad")

    def broken(tensors, folder):
        (Path(folder) / "model-00001-of-00002.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(truncate, "write_sharded", broken)
    with pytest.raises(OSError, match="disk full"):
        truncate_checkpoint(tmp_path / "full", 2, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first1", "full"]
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1


def test_topk_differ_counts_tokens_whose_expert_set_changed():
    from cwgrpo_megatron.megatron.routing import topk_differ

    a = [torch.tensor([[0, 1], [1, 3], [2, 3]]), torch.tensor([[0, 2], [1, 2], [0, 3]])]
    b = [a[0].clone(), torch.tensor([[0, 2], [1, 3], [0, 3]])]
    assert topk_differ(a, a) == 0.0
    assert topk_differ(a, b) == 1 / 6  # one token of one layer went to expert 3, not 2
    with pytest.raises(ValueError, match="2 router calls against 1"):
        topk_differ(a, b[:1])
    with pytest.raises(ValueError, match="not the same tokens"):
        topk_differ(a, [a[0], a[1][:2]])
