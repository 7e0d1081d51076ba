"""The Megatron model built from an HF config reproduces HF logits and log-probs at any layout."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tests.distributed.qwen_fixtures import checkpoint_tensors, make_hf_model, tokens


def _worker(rank, world, name, tp, pp, ep=1, expert_tp=1):
    from megatron.core import parallel_state

    from cwgrpo_megatron.comm import vocab_parallel_logprob_entropy
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.forward import forward_logits
    from cwgrpo_megatron.megatron.model import build_model, load_hf_weights

    hf = make_hf_model(name)
    state = checkpoint_tensors(hf)
    arch = ModelArch.from_hf_dict(hf.config.to_dict())
    parallel.initialize(tp=tp, pp=pp, ep=ep, expert_tp=expert_tp)
    try:
        model = build_model(arch)
        load_hf_weights(model, arch, lambda n: state[n])
        model.eval()
        ids = tokens(seq=48 if name == "llama3-rope" else 12)  # long enough for the scaling
        logits = forward_logits(model, ids, micro_batch_size=2)
        if logits is None:
            return None
        with torch.no_grad():
            ref = hf(ids).logits.double()
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        shard = logits.shape[-1]
        lo, hi = tp_rank * shard, min((tp_rank + 1) * shard, arch.vocab_size)
        logit_err = (logits[..., : hi - lo].double() - ref[..., lo:hi]).abs().max().item()
        target = torch.roll(ids, -1, dims=1)
        logp, entropy = vocab_parallel_logprob_entropy(
            logits, target, group=tp_group, vocab_size=arch.vocab_size
        )
        ref_logp_all = torch.log_softmax(ref, dim=-1)
        ref_logp = ref_logp_all.gather(-1, target[..., None]).squeeze(-1)
        ref_entropy = -(ref_logp_all.exp() * ref_logp_all).sum(-1)
        unscaled_err = None
        if name == "llama3-rope":  # the same weights with plain RoPE: the scaling must show
            twin = _unscaled_twin(hf)
            with torch.no_grad():
                plain = twin(ids).logits.double()
            unscaled_err = (logits[..., : hi - lo].double() - plain[..., lo:hi]).abs().max().item()
        return {
            "unscaled_logits": unscaled_err,
            "logits": logit_err,
            "logp": (logp.double() - ref_logp).abs().max().item(),
            "entropy": (entropy.double() - ref_entropy).abs().max().item(),
        }
    finally:
        parallel.destroy()
        dist.barrier()


def _unscaled_twin(hf):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {k: v for k, v in hf.config.to_dict().items() if k != "rope_scaling"}
    theta = settings["rope_parameters"]["rope_theta"]
    settings["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    twin = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    twin.load_state_dict(hf.state_dict())
    return twin


# Every layout for the untied Qwen2 (vocab 1000 is padded to 1024, so the second TP shard holds
# padding); the tied model where the last stage must copy the embedding (pp > 1) and not (pp 1);
# Qwen3's block (QK norm, no QKV bias, head_dim apart from hidden / heads) at each layout and
# tied; the Llama block (no QKV bias) with tensor parallelism; Llama 3.1's RoPE scaling.
CASES = [
    pytest.param("qwen-untied", 1, 1, id="qwen-untied-tp1"),
    pytest.param("qwen-untied", 2, 1, id="qwen-untied-tp2"),
    pytest.param("qwen-untied", 1, 2, id="qwen-untied-pp2"),
    pytest.param("qwen-untied", 2, 2, id="qwen-untied-tp2xpp2"),
    pytest.param("qwen-tied", 1, 1, id="qwen-tied-tp1"),
    pytest.param("qwen-tied", 2, 2, id="qwen-tied-tp2xpp2"),
    pytest.param("qwen3", 1, 1, id="qwen3-tp1"),
    pytest.param("qwen3", 2, 1, id="qwen3-tp2"),
    pytest.param("qwen3", 1, 2, id="qwen3-pp2"),
    pytest.param("qwen3-tied", 2, 2, id="qwen3-tied-tp2xpp2"),
    pytest.param("llama", 2, 1, id="llama-tp2"),
    pytest.param("qwen3-moe", 1, 1, id="qwen3-moe-tp1"),
    pytest.param("qwen3-moe-unnorm", 1, 1, id="qwen3-moe-unnorm-tp1"),
    pytest.param("qwen3-moe", 2, 1, id="qwen3-moe-tp2"),
    pytest.param("qwen3-moe", 1, 2, id="qwen3-moe-pp2"),
    pytest.param("llama3-rope", 1, 1, id="llama3-rope-tp1"),
]


# Qwen3-MoE's experts split over expert-parallel ranks, alone and beside tensor parallelism
# (expert_tp 1: attention split over tp, whole experts over ep; expert_tp 2: experts split too)
MOE_CASES = [
    pytest.param("qwen3-moe", 1, 2, 1, 2, id="qwen3-moe-ep2"),
    pytest.param("qwen3-moe-unnorm", 1, 2, 1, 2, id="qwen3-moe-unnorm-ep2"),
    pytest.param("qwen3-moe", 2, 2, 1, 4, id="qwen3-moe-tp2xep2"),
    pytest.param("qwen3-moe", 2, 2, 2, 4, id="qwen3-moe-tp2xep2-expert-tp2"),
]


@pytest.mark.parametrize(("name", "tp", "pp"), CASES)
def test_megatron_matches_hf(name, tp, pp):
    _check(run_distributed(_worker, tp * pp, name, tp, pp), tp=tp)


@pytest.mark.parametrize(("name", "tp", "ep", "expert_tp", "world"), MOE_CASES)
def test_moe_megatron_matches_hf(name, tp, ep, expert_tp, world):
    _check(run_distributed(_worker, world, name, tp, 1, ep, expert_tp), tp=tp, world=world)


def _check(results, *, tp, world=None):
    results = [r for r in results if r is not None]
    # one result per last-stage rank: tp of them, times the data-parallel replicas
    assert len(results) == (world // tp if world else 1) * tp
    for r in results:
        assert r["logits"] < 1e-5, r
        assert r["logp"] < 1e-5, r
        assert r["entropy"] < 1e-5, r
        if r["unscaled_logits"] is not None:
            assert r["unscaled_logits"] > 20 * max(r["logits"], 1e-7), r
