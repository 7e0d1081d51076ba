"""GPU paths: the Transformer Engine layer spec reproduces HF logits. Skipped without CUDA."""

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.qwen_fixtures import make_hf_model, tokens

pytestmark = pytest.mark.gpu


def _te_worker(rank, world, name):
    from cwgrpo_megatron.convert.arch import ModelArch
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.forward import forward_logits
    from cwgrpo_megatron.megatron.model import build_model, load_hf_weights, use_transformer_engine

    assert use_transformer_engine(), "transformer-engine is not installed ([gpu] extra)"
    torch.cuda.set_device(0)
    hf = make_hf_model(name).cuda()
    state = hf.state_dict()
    arch = ModelArch.from_hf_dict(hf.config.to_dict())
    parallel.initialize(tp=1, pp=1)
    try:
        model = build_model(arch).cuda().eval()
        load_hf_weights(model, arch, lambda n: state[n])
        ids = tokens().cuda()
        logits = forward_logits(model, ids)[..., : arch.vocab_size]
        with torch.no_grad():
            ref = hf(ids).logits
        return (logits.float() - ref.float()).abs().max().item()
    finally:
        parallel.destroy()


@pytest.mark.parametrize("name", ["qwen-untied", "qwen-tied"])
def test_transformer_engine_spec_matches_hf(name):
    (err,) = run_distributed(_te_worker, 1, name)
    assert err < 1e-3  # TE may use TF32 matmuls
