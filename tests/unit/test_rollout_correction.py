"""Truncated importance sampling and the rollout / trainer log-prob gap (pure tensor code)."""

import math

import pytest
import torch

from cwgrpo_megatron.algo import PolicyBatch, get_policy_loss
from cwgrpo_megatron.algo.metrics import finalize
from cwgrpo_megatron.algo.rollout_correction import truncated_is_weight
from cwgrpo_megatron.config import AlgoConfig, load_config
from tests.unit.test_losses import make_batch


def _loss(cfg, logp, old, adv, mask, rollout=None):
    leaf = logp.clone().requires_grad_()
    batch = PolicyBatch(logp=leaf, old_logp=old, advantages=adv, mask=mask, rollout_logp=rollout)
    out = get_policy_loss("grpo")(batch, cfg)
    (out.loss_sum / out.num_tokens).backward()
    return out, leaf.grad


def test_truncated_weight_is_capped_ratio_without_gradient():
    old = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    rollout = torch.tensor([-1.0, -1.0, -3.0])
    w = truncated_is_weight(old, rollout, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-1.0), 2.0]))
    assert not w.requires_grad


def test_matching_rollout_logprobs_change_nothing():
    logp, old, _, adv, mask = make_batch()
    base, grad = _loss(AlgoConfig(), logp, old, adv, mask)
    out, grad_tis = _loss(AlgoConfig(tis_cap=2.0), logp, old, adv, mask, rollout=old.clone())
    assert torch.allclose(out.loss_sum, base.loss_sum) and torch.allclose(grad_tis, grad)
    metrics = finalize(out.metrics)
    assert float(metrics["rollout/gap_mean"]) == 0 and float(metrics["actor/tis_weight_mean"]) == 1


def test_each_token_surrogate_is_scaled_by_its_weight():
    logp, old, _, adv, mask = make_batch(seed=2)
    gen = torch.Generator().manual_seed(5)
    rollout = old + 0.7 * torch.randn(old.shape, generator=gen, dtype=old.dtype)
    w = torch.exp(old - rollout).clamp(max=1.5)
    plain, grad = _loss(AlgoConfig(), logp, old, adv, mask)
    tis, grad_tis = _loss(AlgoConfig(tis_cap=1.5), logp, old, adv, mask, rollout=rollout)
    assert torch.allclose(grad_tis, grad * w, atol=1e-12)  # the gradient of each token, times w
    metrics = finalize(tis.metrics)
    gap = (old - rollout).abs()
    assert torch.isclose(metrics["rollout/gap_mean"], (gap * mask).sum() / mask.sum())
    assert torch.isclose(metrics["rollout/gap_max"], gap[mask > 0].max())
    # without the cap the gap is still logged, and the loss is the plain one
    logged, _ = _loss(AlgoConfig(), logp, old, adv, mask, rollout=rollout)
    assert torch.equal(logged.loss_sum, plain.loss_sum) and "rollout/gap_mean" in logged.metrics


def test_cap_without_rollout_logprobs_is_an_error():
    logp, old, _, adv, mask = make_batch()
    with pytest.raises(ValueError, match="no rollout log-probs"):
        _loss(AlgoConfig(tis_cap=2.0), logp, old, adv, mask)
    with pytest.raises(ValueError, match="algo.tis_cap=0.5 is out of range"):
        load_config(overrides=["algo.tis_cap=0.5"])
