"""The baselines' reference semantics: kl_cov's exact top-k under ties, dual-clip, the log-ratio
and KL clamps, clip_cov's eligible band, and the group-size-1 warning; float64 references."""

import math
import warnings

import pytest
import torch

from cwgrpo_megatron.algo import PolicyBatch, build_policy_loss
from cwgrpo_megatron.algo.covariance import centred_covariance
from cwgrpo_megatron.algo.draws import token_uniform
from cwgrpo_megatron.algo.kl import kl_term
from cwgrpo_megatron.algo.losses import clip_cuts, top_k_tokens
from cwgrpo_megatron.algo.metrics import finalize
from cwgrpo_megatron.algo.scope import pools_from_index, single_pool
from cwgrpo_megatron.config import AlgoConfig, ConfigWarning, TrainConfig
from tests.reference import ref_dual_clip_loss, ref_top_k_in_order
from tests.unit.test_losses import big_cov_batch, make_batch, run_loss


def kl_cov_selection(cfg, logp, adv, mask, scope=None):
    scope = scope or single_pool(mask.shape[0])
    prepared = build_policy_loss(cfg).prepare(logp, adv, mask, scope=scope, cfg=cfg)
    return prepared.token_stat > 0, finalize(prepared.metrics)


# ---- kl_cov: exactly k tokens, ties in token order ------------------------------------------


@pytest.mark.parametrize("adv_value", [0.0, 1.7], ids=["A=0", "A=const"])
def test_kl_cov_takes_exactly_k_from_a_pool_without_spread(adv_value):
    """All advantages equal: c = 0 on every token, all tie; the first k in order are taken."""
    cfg = AlgoConfig(policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.1}})
    logp, _, _, _, _ = make_batch(seed=1, b=8, s=10)
    mask = torch.ones(8, 10, dtype=torch.float64)  # 80 counted tokens
    adv = torch.full_like(mask, adv_value) * mask
    selected, metrics = kl_cov_selection(cfg, logp, adv, mask)
    assert int(selected.sum()) == 8
    assert torch.equal(selected.reshape(-1), torch.arange(80) < 8)
    assert float(metrics["actor/kl_cov_frac"]) == pytest.approx(0.1)


def test_kl_cov_breaks_partial_ties_at_the_threshold_in_token_order():
    """Three values of c; k falls inside the run of tokens tied at the middle one."""
    cfg = AlgoConfig(policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.25}})
    mask = torch.ones(4, 10, dtype=torch.float64)
    mask[2, 7:] = 0.0  # 37 tokens, k = 9
    logp = torch.zeros(4, 10, dtype=torch.float64)
    logp[0, :4] = 2.0  # 4 tokens with the largest c
    logp[1:, ::2] = 1.0  # 14 counted tokens that tie at the second value
    adv = torch.ones_like(mask) * mask
    adv[:, 5:] = -1.0
    adv = adv * mask
    stats = centred_covariance(logp, adv, mask, single_pool(4))
    top = stats.cov[mask > 0].sort(descending=True).values
    assert top[8] == top[9], "k = 9 must fall inside a run of ties"
    selected, _ = kl_cov_selection(cfg, logp, adv, mask)
    assert int(selected.sum()) == 9
    assert torch.equal(selected, ref_top_k_in_order(stats.cov, mask, 9))


def test_kl_cov_without_ties_equals_topk():
    cfg = AlgoConfig(policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.05}})
    logp, old, _, adv, mask = big_cov_batch(seed=5)
    stats = centred_covariance(old, adv, mask, single_pool(mask.shape[0]))
    k = max(1, math.floor(0.05 * float(mask.sum())))
    selected, _ = kl_cov_selection(cfg, old, adv, mask)
    assert torch.equal(selected, ref_top_k_in_order(stats.cov, mask, k))


def test_kl_cov_exact_k_per_pool_in_the_group_scope():
    """Per-prompt pools, one of them with all-equal rewards: k of each pool, ties in order."""
    cfg = AlgoConfig(policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.2}}, cov_scope="group")
    logp, _, _, adv, mask = make_batch(seed=6, b=9, s=10)
    mask[-1, :3] = 1.0
    adv[3:6] = 0.5 * mask[3:6]  # prompt 1: equal rewards, c = 0 everywhere
    prompt = torch.arange(9) // 3
    scope = pools_from_index(prompt, name="group")
    stats = centred_covariance(logp, adv, mask, scope)
    selected, _ = kl_cov_selection(cfg, logp, adv, mask, scope)
    for p in range(3):
        rows = prompt == p
        k = max(1, math.floor(0.2 * float(mask[rows].sum())))
        expected = ref_top_k_in_order(stats.cov[rows], mask[rows], k)
        assert torch.equal(selected[rows], expected), f"prompt {p}"


def test_top_k_tokens_follows_row_order_not_local_position():
    """The tie-break follows `Scope.row_order` (the global batch order), not the local rows."""
    mask = torch.ones(3, 4, dtype=torch.float64)
    zeros = torch.zeros(3, 4, dtype=torch.float64)
    scope = pools_from_index(
        torch.zeros(3, dtype=torch.long), name="g", row_order=torch.tensor([5, 1, 3])
    )
    stats = centred_covariance(zeros, zeros, mask, scope)
    chosen = top_k_tokens(stats, mask, torch.tensor([6.0], dtype=torch.float64), scope)
    # global order: row 1 (order 1), then row 2 (order 3), then row 0 (order 5)
    assert torch.equal(chosen.sum(dim=1), torch.tensor([0, 4, 2]))
    assert torch.equal(chosen[2], torch.tensor([True, True, False, False]))


# ---- dual-clip ------------------------------------------------------------------------------


def off_policy_batch(seed=2, b=16, s=16):
    """rho spread over (e^-3, e^3), advantages of both signs, some padding."""
    logp, old, ref, _, mask = make_batch(seed=seed, b=b, s=s)
    gen = torch.Generator().manual_seed(seed)
    logp = old + 1.5 * torch.randn(old.shape, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0]).repeat(b // 2).double().unsqueeze(-1) * mask
    return logp, old, ref, adv * torch.rand(b, 1, generator=gen, dtype=torch.float64), mask


def test_dual_clip_bounds_negative_advantage_tokens():
    cfg = AlgoConfig(policy_loss="grpo", clip_ratio_c=3.0)
    logp, old, ref, adv, mask = off_policy_batch()
    value, grad, out = run_loss("grpo", cfg, logp, old, ref, adv, mask)
    rho = torch.exp(logp - old)
    dual = (mask > 0) & (adv < 0) & (rho > 3.0)
    assert dual.sum() >= 3, "the batch must exercise the dual clip"
    leaf = logp.clone().requires_grad_()
    ref_value = ref_dual_clip_loss(leaf, old, adv, mask, eps=0.2, c=3.0)
    ref_value.backward()
    torch.testing.assert_close(value, ref_value.detach(), rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-14, atol=1e-18)
    assert torch.all(grad[dual] == 0)
    metrics = finalize(out.metrics)
    assert float(metrics["actor/clip_frac_dual"]) == pytest.approx(float(dual.sum() / mask.sum()))
    # off by default: the same batch without it differs exactly on the dual-clipped tokens
    plain, plain_grad, plain_out = run_loss(
        "grpo", AlgoConfig(policy_loss="grpo"), logp, old, ref, adv, mask
    )
    assert "actor/clip_frac_dual" not in plain_out.metrics
    assert plain > value
    assert torch.equal(plain_grad[~dual], grad[~dual])


@pytest.mark.parametrize("name", ["cw_grpo", "clip_cov"])
def test_dual_clip_applies_to_the_clipped_losses(name):
    cfg = AlgoConfig(policy_loss=name, clip_ratio_c=2.0, options={"clip_cov": {"ratio": 0.05}})
    logp, old, ref, adv, mask = big_cov_batch(seed=7)
    logp = old + 1.5 * torch.randn(
        logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    gen = torch.Generator().manual_seed(0)
    _, grad, out = run_loss(name, cfg, logp, old, ref, adv, mask, generator=gen)
    dual = (mask > 0) & (adv < 0) & (torch.exp(logp - old) > 2.0)
    assert dual.sum() > 0 and torch.all(grad[dual] == 0)
    assert float(finalize(out.metrics)["actor/clip_frac_dual"]) == pytest.approx(
        float(dual.sum() / mask.sum())
    )


def test_dual_clip_config_is_checked():
    with pytest.raises(ValueError, match="clip_ratio_c=1.0 must be > 1"):
        AlgoConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="does nothing with policy_loss=kl_cov"):
        AlgoConfig(policy_loss="kl_cov", clip_ratio_c=3.0)


# ---- clamps ---------------------------------------------------------------------------------


def test_kl_clamps_are_inactive_near_the_policy():
    """Where neither clamp binds, the KL term is bit-for-bit expm1(x) - x (and k1, k2)."""
    gen = torch.Generator().manual_seed(3)
    logp = -3 * torch.rand(64, generator=gen)
    ref = logp + torch.randn(64, generator=gen)
    x = ref - logp
    for name, expected in (
        ("k1", logp - ref),
        ("k2", 0.5 * x.square()),
        ("k3", torch.expm1(x) - x),
    ):
        got = kl_term(logp, ref, estimator=name, log_ratio_clamp=20.0, kl_clamp=10.0)
        assert expected.abs().max() < 10, "the batch must stay inside the clamps"
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_clamps_bound_the_value_and_keep_the_gradient_finite(dtype):
    logp = torch.tensor([-1.0, -1.0, -1.0, -50.0, -1.0], dtype=dtype, requires_grad=True)
    ref = torch.tensor([-1.0, -0.5, -60.0, -1.0, -200.0], dtype=dtype)
    kl = kl_term(logp, ref, estimator="k3", log_ratio_clamp=20.0, kl_clamp=10.0)
    kl.sum().backward()
    x = (ref - logp).detach()
    assert kl[0] == 0 and kl[1] == torch.expm1(x[1]) - x[1]
    assert torch.all(kl[2:] == 10.0), "far from the reference on either side: clamped at 10"
    assert torch.all(torch.isfinite(logp.grad))
    assert torch.all(logp.grad[2:] == 0), "a clamped token gets no KL gradient"
    assert logp.grad[1] != 0


def test_log_ratio_clamp_bounds_rho_and_cuts_its_gradient():
    cfg = AlgoConfig(policy_loss="grpo", clip_eps_high=math.inf)  # a clip that never binds
    old = torch.tensor([[-100.0, -1.0, -1.0]], dtype=torch.float32)
    logp = torch.tensor([[-1.0, -1.2, -1.0]], dtype=torch.float32)
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    value, grad, out = run_loss("grpo", cfg, logp, old, old, adv, mask)
    assert torch.isfinite(value)
    torch.testing.assert_close(value, -(math.exp(20.0) + math.exp(-0.2) + 1.0) / 3 * torch.ones(()))
    assert grad[0, 0] == 0 and grad[0, 1] != 0
    # unclamped the same token overflows rho (exp(99) in float32 is inf)
    wide, _, _ = run_loss(
        "grpo",
        AlgoConfig(policy_loss="grpo", clip_eps_high=math.inf, log_ratio_clamp=100.0),
        logp,
        old,
        old,
        adv,
        mask,
    )
    assert not torch.isfinite(wide)


# ---- clip_cov: the band excludes tokens a clip already cut ----------------------------------


def test_clip_cov_band_excludes_clipped_tokens_off_policy():
    """A later mini-batch: the policy being updated differs from the sampler, so PPO clips some
    band tokens; clip_cov must not spend its picks on them, and counts only real removals."""
    cfg = AlgoConfig(
        policy_loss="clip_cov",
        options={"clip_cov": {"ratio": 1.0}},
        clip_eps_low=0.1,
        clip_eps_high=0.1,
    )
    _, old, ref, adv, mask = big_cov_batch(seed=3)
    gen = torch.Generator().manual_seed(11)
    policy = old + 0.3 * torch.randn(old.shape, generator=gen, dtype=torch.float64)
    stats = centred_covariance(policy, adv, mask, single_pool(mask.shape[0]))
    loss = build_policy_loss(cfg)
    band = (mask > 0) & (stats.cov > loss.lb) & (stats.cov < loss.ub)
    ppo, _ = clip_cuts(torch.exp(policy - old), adv, cfg)
    assert (band & ppo).sum() > 5 and (band & ~ppo).sum() > 5, "a partially clipped band"
    prepared = build_policy_loss(cfg).prepare(
        policy,
        adv,
        mask,
        scope=single_pool(mask.shape[0]),
        cfg=cfg,
        old_logp=old,
        generator=torch.Generator().manual_seed(0),
    )
    detached = prepared.token_stat == 0
    # ratio 1: every eligible token is picked, and only those
    assert torch.equal(detached, band & ~ppo)
    value, grad, out = run_loss(
        "clip_cov", cfg, policy, old, ref, adv, mask, token_stat=prepared.token_stat
    )
    grpo_value, grpo_grad, _ = run_loss("grpo", cfg, policy, old, ref, adv, mask)
    torch.testing.assert_close(value, grpo_value)
    torch.testing.assert_close(grad, torch.where(detached, 0.0, grpo_grad))
    frac = float(finalize(out.metrics)["actor/clip_cov_frac"])
    assert frac == pytest.approx(float((band & ~ppo).sum() / mask.sum()))
    # on-policy (old_logp omitted: rho = 1) nothing is clipped, so the whole band is eligible
    on_policy = build_policy_loss(cfg).prepare(
        policy,
        adv,
        mask,
        scope=single_pool(mask.shape[0]),
        cfg=cfg,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(on_policy.token_stat == 0, band)


def test_clip_cov_frac_counts_only_tokens_whose_gradient_was_removed():
    """A token detached by prepare but clipped in the training pass loses nothing: not counted."""
    cfg = AlgoConfig(policy_loss="clip_cov")
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)  # token 0 is clipped
    keep = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    out = build_policy_loss(cfg)(
        PolicyBatch(logp=logp, old_logp=old, advantages=adv, mask=mask, token_stat=keep), cfg
    )
    assert float(finalize(out.metrics)["actor/clip_cov_frac"]) == pytest.approx(0.25)


# ---- group size 1 ---------------------------------------------------------------------------


def test_group_size_one_is_a_config_warning():
    with pytest.warns(ConfigWarning, match="learns nothing"):
        TrainConfig(group_size=1, prompts_per_step=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainConfig(group_size=2, prompts_per_step=4)


def test_token_draws_are_uniform_deterministic_and_keyed():
    order = torch.arange(100_000, dtype=torch.float64).reshape(1000, 100)
    u = token_uniform(order, torch.tensor(3))
    assert torch.equal(u, token_uniform(order, torch.tensor(3)))
    assert u.min() >= 0 and u.max() < 1
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - 5000) ** 2 / 5000).sum())
    assert chi2 < 43.8, f"chi-square {chi2} over 19 degrees of freedom (p = 0.001)"
    flat = u.reshape(-1)
    assert abs(float(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1])) < 0.02
    other = token_uniform(order, torch.tensor(4)).reshape(-1)
    assert abs(float(torch.corrcoef(torch.stack([flat, other]))[0, 1])) < 0.02
    # a token's draw depends on its position only, not on what else is drawn with it
    assert torch.equal(token_uniform(order[500:501, 7:9], torch.tensor(3)), u[500:501, 7:9])
