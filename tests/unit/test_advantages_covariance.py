"""Group advantages and CW-GRPO's covariance weights against float64 references: equal
rewards (w = 1), a group of one, a single extreme token down-weighted, padding, no tokens,
kernel underflow and the shift that keeps precision, the three scopes, and hypothesis
properties (mean one over the scope, weights in [0, N])."""

import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cwgrpo_megatron.algo import covariance_weights, group_advantages
from cwgrpo_megatron.algo.advantages import broadcast_to_tokens, get_advantage_estimator
from cwgrpo_megatron.algo.scope import pools_from_index, single_pool
from cwgrpo_megatron.comm import group_scope, micro_batch_scope
from cwgrpo_megatron.comm.scopes import LayoutDependentWarning
from tests.pooled import covariance_weights as dist_covariance_weights
from tests.reference import (
    centred_exactly,
    ref_group_advantages,
    ref_weights,
    ref_weights_pooled,
)


def weights(logp, adv, mask):
    w, _ = covariance_weights(logp, adv, mask, single_pool(mask.shape[0]))
    return w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_pool_of_equal_advantages_weighs_every_token_one(dtype):
    """c = 0 in exact arithmetic when every counted advantage is equal (or every log-prob):
    w = 1, though in float64 the mean of seven 0.6s is not 0.6 (the rounding once made the
    kernel a Gaussian of the log-probs; found by the property test below)."""
    logp = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0]], dtype=dtype)
    mask = torch.tensor([[1.0] * 7 + [0.0]])
    adv = torch.full((1, 8), 0.6, dtype=dtype) * mask
    expected = torch.tensor([[1.0] * 7 + [0.0]])
    assert torch.equal(weights(logp, adv, mask), expected)
    same_logp = torch.full((1, 8), -0.3, dtype=dtype)
    varied = torch.tensor([[0.1, -0.2, 0.3, 0.5, -0.7, 0.2, 0.4, 0.0]], dtype=dtype) * mask
    assert torch.equal(weights(same_logp, varied, mask), expected)


@pytest.mark.parametrize("std_normalize", [True, False], ids=["grpo", "dr_grpo"])
def test_group_advantages_match_reference(std_normalize):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.0]])
    got = group_advantages(rewards, std_normalize=std_normalize, eps=1e-6)
    want = ref_group_advantages(rewards, std_normalize, 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[1], torch.zeros(4)), "equal rewards must give exactly zero"
    assert get_advantage_estimator("grpo") is group_advantages


def test_group_of_size_one_has_zero_advantage():
    assert torch.equal(group_advantages(torch.tensor([[3.0], [-2.0]])), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="rewards must be"):
        group_advantages(torch.ones(4))


def _random_batch(gen, b=6, s=9, pad=True):
    logp = -3.0 * torch.rand(b, s, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, s).contiguous()
    mask = torch.ones(b, s)
    if pad:
        lengths = torch.randint(1, s + 1, (b,), generator=gen)
        mask = (torch.arange(s)[None] < lengths[:, None]).float()
    return logp, adv * mask, mask


def test_weights_match_reference_on_random_batch():
    gen = torch.Generator().manual_seed(1)
    logp, adv, mask = _random_batch(gen)
    torch.testing.assert_close(weights(logp, adv, mask).double(), ref_weights(logp, adv, mask))
    # the public dist entry point with group=None is the same single-process computation
    torch.testing.assert_close(dist_covariance_weights(logp, adv, mask), weights(logp, adv, mask))


def test_all_rewards_equal_gives_unit_weights():
    gen = torch.Generator().manual_seed(2)
    rewards = torch.full((3, 4), 0.7)
    adv_seq = group_advantages(rewards).reshape(-1)
    mask = torch.ones(12, 5)
    logp = -torch.rand(12, 5, generator=gen)
    w = weights(logp, broadcast_to_tokens(adv_seq, mask), mask)
    assert torch.equal(w, torch.ones(12, 5))


def test_single_extreme_token_is_down_weighted():
    mask = torch.ones(4, 8)
    logp = torch.full((4, 8), -1.0)
    logp[0, 3] = -25.0  # one very unlikely token in a positive-advantage response
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 8).contiguous()
    w = weights(logp, adv, mask)
    ref = ref_weights(logp, adv, mask)
    torch.testing.assert_close(w.double(), ref)
    assert w[0, 3] < 1e-3
    assert w.sum() == pytest.approx(32.0, rel=1e-6)
    others = torch.ones_like(mask, dtype=torch.bool)
    others[0, 3] = False
    assert torch.all(w[others] > 1.0)


def test_masked_padding_changes_nothing():
    gen = torch.Generator().manual_seed(3)
    logp, adv, mask = _random_batch(gen, pad=True)
    garbage_logp = torch.where(mask > 0, logp, torch.full_like(logp, 1e6))
    garbage_adv = torch.where(mask > 0, adv, torch.full_like(adv, -1e6))
    w = weights(garbage_logp, garbage_adv, mask)
    torch.testing.assert_close(w, weights(logp, adv, mask))
    assert torch.all(w[mask == 0] == 0)
    assert torch.isfinite(w).all()


def test_no_tokens_gives_zeros_not_nan():
    mask = torch.zeros(3, 4)
    w = weights(torch.randn(3, 4), torch.randn(3, 4), mask)
    assert torch.equal(w, torch.zeros(3, 4))


def test_kernel_underflow_everywhere_falls_back_to_sigma_zero_rule():
    # c = (l - l_bar)(A - A_bar) is nearly constant: |c| ~ 1 while sigma ~ 1e-9, so every
    # exp(-c^2 / 2 sigma^2) underflows; the pool must not produce 0/0.
    logp = torch.tensor([[1.0, -1.0 + 1e-9]], dtype=torch.float64).T.contiguous()
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64).T.contiguous()
    mask = torch.ones(2, 1)
    w = weights(logp, adv, mask)
    assert torch.isfinite(w).all()
    assert w.sum() == pytest.approx(2.0)


def test_shift_keeps_precision_when_c_is_far_from_zero():
    # |c_bar| >> sigma but not degenerate: the unshifted kernel would underflow everywhere.
    logp = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)[:, None]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)[:, None] * 40.0
    logp = logp + torch.tensor([0.0, 0.0, 0.02, -0.03], dtype=torch.float64)[:, None]
    mask = torch.ones(4, 1)
    w = weights(logp, adv, mask).double()
    lv, av = logp[:, 0], adv[:, 0]
    c = (lv - lv.mean()) * (av - av.mean())
    log_w = -(c**2) / (2 * c.var(correction=0))
    want = torch.softmax(log_w, 0) * 4  # the same normalised kernel, computed in log space
    torch.testing.assert_close(w[:, 0], want, rtol=1e-5, atol=1e-9)


def test_group_scope_gives_mean_one_per_group():
    gen = torch.Generator().manual_seed(4)
    logp, adv, mask = _random_batch(gen, b=8)
    prompt = torch.tensor([0, 0, 0, 0, 5, 5, 5, 5])
    w, _ = covariance_weights(logp, adv, mask, group_scope(prompt))
    torch.testing.assert_close(w.double(), ref_weights_pooled(logp, adv, mask, prompt))
    for rows in (slice(0, 4), slice(4, 8)):
        assert (w[rows] * mask[rows]).sum() == pytest.approx(mask[rows].sum().item(), rel=1e-6)


def test_micro_batch_scope_warns_and_pools_per_micro_batch():
    gen = torch.Generator().manual_seed(5)
    logp, adv, mask = _random_batch(gen, b=6)
    mb = torch.tensor([0, 0, 0, 1, 1, 1])
    with pytest.warns(LayoutDependentWarning, match="depends|change with the parallel layout"):
        scope = micro_batch_scope(mb)
    w, _ = covariance_weights(logp, adv, mask, scope)
    torch.testing.assert_close(w.double(), ref_weights_pooled(logp, adv, mask, mb))
    assert not torch.allclose(w, weights(logp, adv, mask))


def test_relabelled_pools_are_equivalent():
    gen = torch.Generator().manual_seed(6)
    logp, adv, mask = _random_batch(gen, b=4)
    a, _ = covariance_weights(
        logp, adv, mask, pools_from_index(torch.tensor([7, 7, 2, 2]), name="g")
    )
    b, _ = covariance_weights(
        logp, adv, mask, pools_from_index(torch.tensor([0, 0, 1, 1]), name="g")
    )
    assert torch.equal(a, b)


# Float64 represents the statistics while c^2 does: values are exactly zero (equal rewards, a
# certain token) or at least 1e-6 in magnitude, as GRPO log-probs and advantages are. Nearer
# zero (hypothesis found 1e-162) c^2 underflows in the implementation and the reference alike.
def _representable(x: float) -> bool:
    return x == 0.0 or abs(x) >= 1e-6


token_values = st.floats(min_value=-8.0, max_value=0.0, allow_nan=False, width=64).filter(
    _representable
)
advantage_values = st.floats(-3, 3, width=64).filter(_representable)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 6),
    cols=st.integers(1, 8),
)
def test_property_mean_one_and_bounded(data, rows, cols):
    logp = torch.tensor(
        data.draw(st.lists(token_values, min_size=rows * cols, max_size=rows * cols)),
        dtype=torch.float64,
    ).reshape(rows, cols)
    seq_adv = data.draw(st.lists(advantage_values, min_size=rows, max_size=rows))
    lengths = data.draw(st.lists(st.integers(0, cols), min_size=rows, max_size=rows))
    mask = (torch.arange(cols)[None] < torch.tensor(lengths)[:, None]).float()
    adv = torch.tensor(seq_adv, dtype=torch.float64)[:, None] * mask
    n = int(mask.sum())
    assume(n > 0)
    sel = mask > 0
    c = centred_exactly(logp[sel]) * centred_exactly(adv[sel])
    sigma = c.std(correction=0)
    # Positivity holds in real arithmetic; float64 represents it while c^2 / 2 sigma^2 < ~700.
    assume(sigma == 0 or bool(((c**2) / (2 * sigma**2)).max() < 600))
    w = weights(logp, adv, mask).double()
    assert w[sel].mean().item() == pytest.approx(1.0, rel=1e-5)
    raw = torch.ones_like(c) if sigma == 0 else torch.exp(-(c**2) / (2 * sigma**2))
    bound = n / raw.sum()
    assert torch.all(w[sel] > 0)
    assert torch.all(w[sel] <= bound * (1 + 1e-5))
    assert torch.all(w[~sel] == 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(w, ref_weights(logp, adv, mask), rtol=1e-5, atol=1e-6)
