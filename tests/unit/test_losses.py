"""The policy losses (grpo, cw_grpo, clip_cov, kl_cov), the KL estimators and the loss
aggregations: values and gradients against autograd of float64 references, clip_cov's band
and kl_cov's top-k selection, clip fractions, and metrics that merge over micro-batches into
the whole batch's."""

import dataclasses
import re

import pytest
import torch

from cwgrpo_megatron.algo import (
    PolicyBatch,
    PolicyLoss,
    build_policy_loss,
    get_policy_loss,
    needs_policy_pass,
)
from cwgrpo_megatron.algo.aggregation import get_loss_aggregation
from cwgrpo_megatron.algo.covariance import centred_covariance
from cwgrpo_megatron.algo.kl import get_kl_estimator
from cwgrpo_megatron.algo.losses import POLICY_LOSSES, kth_largest
from cwgrpo_megatron.algo.metrics import (
    covariance_metrics,
    effective_covariance_metrics,
    finalize,
    merge,
)
from cwgrpo_megatron.algo.scope import pools_from_index, single_pool
from cwgrpo_megatron.comm import reduce_metrics
from cwgrpo_megatron.config import AlgoConfig
from tests.reference import ref_surrogate_loss, ref_weights

AGGS = [
    pytest.param(dict(loss_agg="token-mean"), id="token-mean"),
    pytest.param(dict(loss_agg="seq-mean-token-mean"), id="seq-mean-token-mean"),
    pytest.param(
        dict(loss_agg="seq-mean-token-sum-norm", loss_norm_length=16), id="seq-mean-token-sum-norm"
    ),
]


def make_batch(seed=0, b=6, s=10):
    gen = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(b, s, generator=gen, dtype=torch.float64)
    logp = old + 0.3 * torch.randn(b, s, generator=gen, dtype=torch.float64)  # some clipping
    ref = old + 0.1 * torch.randn(b, s, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    lengths[-1] = 0  # one all-padding row
    mask = (torch.arange(s)[None] < lengths[:, None]).double()
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64) * mask
    return logp, old, ref, adv, mask


def run_loss(name, cfg, logp, old, ref, adv, mask, token_stat=None, generator=None):
    loss = get_policy_loss(name, **cfg.options.get(name, {}))
    if token_stat is None:
        token_stat = loss.prepare(
            old, adv, mask, scope=single_pool(mask.shape[0]), cfg=cfg, generator=generator
        ).token_stat
    leaf = logp.clone().requires_grad_()
    out = loss(
        PolicyBatch(
            logp=leaf, old_logp=old, advantages=adv, mask=mask, token_stat=token_stat, ref_logp=ref
        ),
        cfg,
    )
    value = out.loss_sum / out.num_tokens
    value.backward()
    return value.detach(), leaf.grad, out


def ref_loss_and_grad(cfg, logp, old, ref, adv_hat, mask):
    leaf = logp.clone().requires_grad_()
    value = ref_surrogate_loss(
        leaf,
        old,
        adv_hat,
        mask,
        eps_low=cfg.clip_eps_low,
        eps_high=cfg.clip_eps_high,
        beta=cfg.kl_beta,
        ref_logp=ref,
        agg=cfg.loss_agg,
        norm_length=cfg.loss_norm_length,
    )
    value.backward()
    return value.detach(), leaf.grad


def test_registry_has_the_four_losses():
    assert POLICY_LOSSES.names() == ["clip_cov", "cw_grpo", "grpo", "kl_cov"]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
def test_grpo_matches_reference(agg, beta):
    cfg = AlgoConfig(policy_loss="grpo", kl_beta=beta, clip_eps_high=0.28, **agg)
    logp, old, ref, adv, mask = make_batch()
    value, grad, _ = run_loss("grpo", cfg, logp, old, ref, adv, mask)
    ref_value, ref_grad = ref_loss_and_grad(cfg, logp, old, ref, adv, mask)
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grad, ref_grad)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("agg", AGGS)
def test_cw_grpo_matches_reference(agg):
    cfg = AlgoConfig(policy_loss="cw_grpo", kl_beta=0.04, **agg)
    logp, old, ref, adv, mask = make_batch(seed=1)
    value, grad, _ = run_loss("cw_grpo", cfg, logp, old, ref, adv, mask)
    adv_hat = ref_weights(old, adv, mask) * adv
    ref_value, ref_grad = ref_loss_and_grad(cfg, logp, old, ref, adv_hat, mask)
    torch.testing.assert_close(value, ref_value, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)


def test_cw_grpo_with_unit_weights_equals_grpo():
    cfg = AlgoConfig(kl_beta=0.04)
    logp, old, ref, adv, mask = make_batch(seed=2)
    ones = torch.ones_like(mask)
    cw = run_loss("cw_grpo", cfg, logp, old, ref, adv, mask, token_stat=ones)
    plain = run_loss("grpo", cfg, logp, old, ref, adv, mask)
    assert torch.equal(cw[0], plain[0])
    assert torch.equal(cw[1], plain[1])


def test_cw_grpo_without_prepare_is_a_clear_error():
    cfg = AlgoConfig()
    logp, old, ref, adv, mask = make_batch()
    batch = PolicyBatch(logp=logp, old_logp=old, advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="run prepare"):
        get_policy_loss("cw_grpo")(batch, cfg)
    with pytest.raises(ValueError, match="kl_beta > 0 needs ref_logp"):
        get_policy_loss("grpo")(batch, dataclasses.replace(cfg, kl_beta=0.1))


def big_cov_batch(seed=3, b=16, s=64):
    """Covariances of order 1-10, so that the Cui et al. bands and top-k select something."""
    logp, old, ref, adv, mask = make_batch(seed=seed, b=b, s=s)
    return logp, old * 3.0, ref, adv * 2.0, mask


def test_clip_cov_detaches_band_tokens_only():
    cfg = AlgoConfig(policy_loss="clip_cov", options={"clip_cov": {"ratio": 0.05}})
    logp, old, ref, adv, mask = big_cov_batch()
    stats = centred_covariance(old, adv, mask, single_pool(mask.shape[0]))
    loss = build_policy_loss(cfg)
    band = (mask > 0) & (stats.cov > loss.lb) & (stats.cov < loss.ub)
    assert band.sum() > 20
    gen = torch.Generator().manual_seed(0)
    keep = (
        build_policy_loss(cfg)
        .prepare(old, adv, mask, scope=single_pool(mask.shape[0]), cfg=cfg, generator=gen)
        .token_stat
    )
    detached = keep == 0
    assert detached.sum() > 0
    assert torch.all(band[detached]), "only tokens inside the covariance band are detached"
    expected = max(1.0, float(torch.floor(loss.ratio * mask.sum())))
    assert abs(detached.sum().item() - expected) < 4 * expected**0.5 + 1
    # the gradient is that of the grpo loss with the detached tokens' gradient removed
    value, grad, _ = run_loss("clip_cov", cfg, logp, old, ref, adv, mask, token_stat=keep)
    grpo_value, grpo_grad, _ = run_loss("grpo", cfg, logp, old, ref, adv, mask)
    torch.testing.assert_close(value, grpo_value)
    torch.testing.assert_close(grad, torch.where(detached, 0.0, grpo_grad))
    with pytest.raises(ValueError, match="torch.Generator"):
        build_policy_loss(cfg).prepare(old, adv, mask, scope=single_pool(mask.shape[0]), cfg=cfg)


def test_kl_cov_selects_top_k_and_matches_reference():
    cfg = AlgoConfig(policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.02, "coef": 0.5}})
    logp, old, ref, adv, mask = big_cov_batch(seed=4)
    sel = mask > 0
    c = (old - old[sel].mean()) * (adv - adv[sel].mean())
    loss = build_policy_loss(cfg)
    k = int(max(1, int(loss.ratio * sel.sum())))
    top = torch.zeros_like(mask, dtype=torch.bool)
    flat_idx = torch.nonzero(sel.reshape(-1)).squeeze(-1)
    top.view(-1)[flat_idx[torch.topk(c[sel], k).indices]] = True
    value, grad, _ = run_loss("kl_cov", cfg, logp, old, ref, adv, mask)
    selected = (
        build_policy_loss(cfg)
        .prepare(old, adv, mask, scope=single_pool(mask.shape[0]), cfg=cfg)
        .token_stat
    )
    assert torch.equal(selected > 0, top)
    leaf = logp.clone().requires_grad_()
    per_token = -torch.exp(leaf - old) * adv + loss.coef * (leaf - old).abs() * top
    ref_value = (per_token * mask).sum() / mask.sum()
    ref_value.backward()
    torch.testing.assert_close(value, ref_value.detach())
    torch.testing.assert_close(grad, leaf.grad)


@pytest.mark.parametrize("k_per_pool", [[1, 1, 1], [3, 7, 12], [5, 36, 2]])
def test_kth_largest_matches_sort_per_pool(k_per_pool):
    gen = torch.Generator().manual_seed(7)
    logp, _, _, adv, _ = make_batch(seed=8, b=9, s=12)
    mask = torch.ones(9, 12, dtype=torch.float64)  # 36 tokens per pool
    scope = pools_from_index(torch.arange(9) // 3, name="group")
    stats = centred_covariance(logp, adv + torch.randn(9, 12, generator=gen) * mask, mask, scope)
    k = torch.tensor(k_per_pool, dtype=torch.float64)
    threshold = kth_largest(stats, mask, k, scope)
    for pool in range(3):
        rows = scope.segment == pool
        vals = stats.cov[rows][mask[rows] > 0].sort(descending=True).values
        assert threshold[pool] == vals[k_per_pool[pool] - 1]


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -2.0, -0.1], dtype=torch.float64)
    log_r = ref - logp
    torch.testing.assert_close(get_kl_estimator("k1")(log_r), logp - ref)
    torch.testing.assert_close(get_kl_estimator("k2")(log_r), 0.5 * log_r**2)
    torch.testing.assert_close(get_kl_estimator("k3")(log_r), log_r.exp() - 1 - log_r)
    assert torch.all(get_kl_estimator("k3")(log_r) >= 0)
    with pytest.raises(ValueError, match="choose one of: k1, k2, k3"):
        get_kl_estimator("k9")


def test_aggregations_count_only_real_rows():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    s, n = get_loss_aggregation("token-mean")(per_token, mask)
    assert (s.item(), n.item()) == (10.0, 4.0)
    s, n = get_loss_aggregation("seq-mean-token-mean")(per_token, mask)
    assert (s.item(), n.item()) == (6.0, 2.0)
    s, n = get_loss_aggregation("seq-mean-token-sum-norm")(per_token, mask, norm_length=5)
    assert (s.item(), n.item()) == (2.0, 2.0)
    with pytest.raises(ValueError, match="norm_length"):
        get_loss_aggregation("seq-mean-token-sum-norm")(per_token, mask)


def test_metrics_merge_over_micro_batches_equals_whole_batch():
    cfg = AlgoConfig()
    logp, old, ref, adv, mask = make_batch(seed=9, b=8)
    loss = get_policy_loss("cw_grpo")
    prepared = loss.prepare(old, adv, mask, scope=single_pool(8), cfg=cfg)
    entropy = torch.rand(8, 10, dtype=torch.float64)

    def metrics(rows):
        batch = PolicyBatch(
            logp=logp[rows],
            old_logp=old[rows],
            advantages=adv[rows],
            mask=mask[rows],
            token_stat=prepared.token_stat[rows],
            entropy=entropy[rows],
        )
        return loss(batch, cfg).metrics

    whole = finalize(merge(metrics(slice(0, 8)), prepared.metrics))
    parts = finalize(
        reduce_metrics(merge(merge(metrics(slice(0, 3)), metrics(slice(3, 8))), prepared.metrics))
    )
    assert whole.keys() == parts.keys()
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], msg=name)
    w = prepared.token_stat[mask > 0].double()
    torch.testing.assert_close(whole["cw/w_min"], w.min())
    torch.testing.assert_close(whole["cw/w_max"], w.max())
    torch.testing.assert_close(whole["cw/ess"], w.sum() ** 2 / (w.numel() * (w**2).sum()))
    torch.testing.assert_close(whole["actor/entropy"], entropy[mask > 0].mean())
    cov = centred_covariance(old, adv, mask, single_pool(8)).cov[mask > 0]
    torch.testing.assert_close(whole["cw/sigma"], cov.std(correction=0))
    torch.testing.assert_close(whole["cw/cov_mean"], cov.mean())
    frac = (w < 0.5).double().mean()
    torch.testing.assert_close(whole["cw/frac_w_below_half"], frac)
    # the covariance the update sees, w~ c: smaller tails than c's where w~ damps them
    weighted = w * cov
    torch.testing.assert_close(whole["cw/cov_abs_max"], cov.abs().max())
    torch.testing.assert_close(whole["cw/eff_cov_mean"], weighted.mean())
    torch.testing.assert_close(whole["cw/eff_cov_abs_max"], weighted.abs().max())
    assert whole["cw/eff_cov_abs_max"] < whole["cw/cov_abs_max"]
    assert whole["cw/eff_top1pct_cov_share"] < whole["cw/top1pct_cov_share"]


def test_the_effective_covariance_with_unit_weights_is_the_covariance():
    _, old, _, adv, mask = make_batch(seed=3, b=8)
    stats = centred_covariance(old, adv, mask, single_pool(8))
    raw = finalize(covariance_metrics(stats, mask))
    eff = finalize(effective_covariance_metrics(mask.float(), stats.cov, mask))
    for name in ("cov_mean", "cov_abs_max", "top1pct_cov_share"):
        torch.testing.assert_close(eff[f"cw/eff_{name}"], raw[f"cw/{name}"], msg=name)


def test_clip_fractions_count_where_the_clip_cuts_the_gradient():
    """clip_frac_high: A > 0 and rho > 1 + eps_high; clip_frac_low: A < 0 and rho < 1 - eps_low;
    both over all counted tokens. Tokens clipped on the side that keeps the gradient count in
    neither."""
    cfg = AlgoConfig(clip_eps_low=0.2, clip_eps_high=0.3)
    rho = torch.tensor([[1.5, 1.1, 0.5, 1.5, 0.5, 0.9, 0.5, 2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.float64)  # the last is padding
    old = torch.zeros_like(rho)
    _, _, out = run_loss("grpo", cfg, rho.log(), old, old, adv * mask, mask)
    final = finalize(out.metrics)
    # high: token 0 (1.5 > 1.3, A > 0); low: tokens 2 and 6 (0.5 < 0.8, A < 0); not token 3
    # (rho high, A < 0: unclipped wins) or 4 (rho low, A > 0), nor the padded token 7
    assert float(final["actor/clip_frac_high"]) == pytest.approx(1 / 7)
    assert float(final["actor/clip_frac_low"]) == pytest.approx(2 / 7)


@pytest.mark.parametrize(
    ("loss", "stats_logp", "mini_batches", "expected"),
    [
        ("grpo", "trainer", 1, False),  # l_old and the diagnostics from the training pass
        ("cw_grpo", "trainer", 1, True),  # w~ before the update
        ("clip_cov", "trainer", 1, True),
        ("kl_cov", "trainer", 1, True),
        ("cw_grpo", "rollout", 1, False),  # w~ from the engine's log-probs
        ("grpo", "trainer", 2, True),  # l_old of mini-batch 1
    ],
)
def test_the_forward_only_pass_runs_only_where_the_step_reads_it(
    loss, stats_logp, mini_batches, expected
):
    cfg = AlgoConfig(policy_loss=loss, stats_logp=stats_logp)
    assert needs_policy_pass(cfg, mini_batches) is expected


def test_a_loss_with_its_own_prepare_is_taken_to_read_token_stat():
    class OwnStatistics(PolicyLoss):
        def prepare(self, *args, **kwargs):
            return super().prepare(*args, **kwargs)

    class DiagnosticsOnly(PolicyLoss):
        uses_token_stat = False

        def prepare(self, *args, **kwargs):
            return super().prepare(*args, **kwargs)

    class SurrogateOnly(PolicyLoss):
        def token_loss(self, batch, cfg):
            return super().token_loss(batch, cfg)

    assert OwnStatistics.uses_token_stat and not DiagnosticsOnly.uses_token_stat
    assert not SurrogateOnly.uses_token_stat and not PolicyLoss.uses_token_stat
    assert {name: POLICY_LOSSES.get(name).uses_token_stat for name in POLICY_LOSSES.names()} == {
        "grpo": False,
        "cw_grpo": True,
        "clip_cov": True,
        "kl_cov": True,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            ["rollout.placement=separate", "rollout.async_steps=1"],
            "rollout.async_steps=1: the engine sampled with the policy one step behind",
            id="async",
        ),
        pytest.param(["rollout.top_p=0.9"], "truncated distribution", id="top-p"),
        pytest.param(["rollout.top_k=20"], "truncated distribution", id="top-k"),
        pytest.param(
            ["train.ppo_mini_batches=2"], "train.ppo_mini_batches=2: mini-batch k > 0", id="mini"
        ),
        pytest.param(["algo.stats_logp=engine"], "choose one of: trainer, rollout", id="name"),
    ],
)
def test_engine_statistics_are_refused_where_they_are_not_the_updated_policy(overrides, message):
    from cwgrpo_megatron.config import load_config

    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(overrides=["algo.stats_logp=rollout", *overrides])
    load_config(overrides=[o for o in overrides if "stats_logp" not in o])  # fine with trainer
