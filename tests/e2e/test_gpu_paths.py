"""GPU paths: the Transformer Engine layer spec reproduces HF logits; vLLM on GPU syncs, sleeps
and generates. Skipped without CUDA."""

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


def _vllm_gpu_worker(rank, world, hf_dir):
    from cwgrpo_megatron.checks.sync_check import run_check
    from cwgrpo_megatron.rollout import SamplingConfig, get_engine

    torch.cuda.set_device(0)
    engine = get_engine("vllm")(
        hf_dir, dtype="float32", max_model_len=128, seed=0, enable_sleep_mode=True
    )
    assert engine.sleep_mode, "sleep mode should be on with CUDA"
    # level 1 keeps the weights in host memory: the check's start gap is the fresh engine's
    engine.sleep(1)
    engine.wake(["weights"])
    engine.wake(["kv_cache"])
    report = run_check(hf_dir=hf_dir, backend="vllm", rounds=2, engine=engine)
    groups = engine.generate([[5, 6, 7]], 2, SamplingConfig(max_tokens=4, seed=0))
    engine.shutdown()
    return report, [c.token_ids for g in groups for c in g.completions]


def test_vllm_on_gpu_syncs_sleeps_and_generates(tmp_path):
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen2

    hf_dir = str(save_tiny_qwen2(tmp_path / "hf"))
    report, samples = run_distributed(_vllm_gpu_worker, 1, hf_dir, timeout=600)[0]
    assert max(report["max_abs"]) < 1e-3  # GPU kernels may use TF32
    assert min(report["stale_max_abs"]) > 1e-2
    assert len(samples) == 2 and all(len(s) >= 1 for s in samples)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU for the engine")
def test_an_engine_on_a_gpu_of_its_own_takes_its_weights_over_nccl(tiny, tmp_path):
    """rollout.placement=separate on two GPUs: the trainer on GPU 0, the engine on GPU 1, one
    step off; every sync goes over vLLM's NCCL transfer and the check after it passes."""
    from tests.e2e.test_train import MODULE, check_run_folder, launch, torchrun, train_args

    out = tmp_path / "run"
    separate = (
        "rollout.placement=separate",
        "rollout.gpus_per_node=1",
        "rollout.async_steps=1",
        "run.verify_sync=1",
    )
    code, log = launch([*torchrun(1), "-m", MODULE, *train_args(tiny, out, *separate)])
    assert code == 0, log
    assert "weight sync path: nccl" in log and "weight sync path: shm" not in log
    rows = check_run_folder(out, 3)
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["sync/gap"] <= r["sync/tol"] for r in rows)
