"""Each CUDA-only call that megatron-core makes is redirected inside on_cpu(), and only there."""

from types import SimpleNamespace

import pytest
import torch

from cwgrpo_megatron.megatron.cpu import check_cpu_config, on_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the redirection is CPU-only")


def test_device_arguments_are_redirected_only_inside():
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")
    with on_cpu():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.empty(3, device=torch.device("cuda", 0)).device.type == "cpu"
        x = torch.arange(3)
        assert x.cuda() is x
        assert x.to("cuda").device.type == "cpu"
        assert x.to(device="cuda", dtype=torch.float32).dtype == torch.float32
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        torch.cuda.synchronize()
        torch.cuda.current_stream().wait_stream(None)
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_nested_contexts_restore_once():
    with on_cpu():
        with on_cpu():
            assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_model_parallel_rng_tracker_forks_cpu_state():
    from megatron.core.tensor_parallel import random as mp_random

    with on_cpu():
        mp_random.model_parallel_cuda_manual_seed(
            7, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
        )
        tracker = mp_random.get_cuda_rng_tracker()
        torch.manual_seed(0)
        before = torch.get_rng_state()
        with tracker.fork():
            first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before), "fork must restore the default state"
        with tracker.fork():
            second = torch.rand(3)
        assert not torch.equal(first, second), "the tracked state advances between forks"
        mp_random.model_parallel_cuda_manual_seed(
            7, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
        )
        with mp_random.get_cuda_rng_tracker().fork():
            assert torch.equal(torch.rand(3), first), "the same seed replays the same stream"


@pytest.mark.parametrize("flag", ["apply_rope_fusion", "gradient_accumulation_fusion"])
def test_unsupported_cpu_settings_are_rejected(flag):
    with pytest.raises(ValueError, match=f"{flag}.*set {flag}=False"):
        check_cpu_config(SimpleNamespace(**{flag: True}))
