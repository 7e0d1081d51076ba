"""Policy losses behind one interface (pure tensor code).

Every loss works in two phases:

1. `prepare(policy_logp, advantages, mask, scope=..., cfg=..., old_logp=...)`, once per
   optimizer step, computes a per-token constant `token_stat [b, s]` from scope statistics
   (e.g. CW-GRPO's w~). `policy_logp` are the detached log-probs of the policy about to be
   updated (a forward-only pass, the engine's sampling log-probs with
   `algo.stats_logp=rollout`, or, for a loss that reads no token_stat, the training pass's,
   after it: `needs_policy_pass`); they equal `old_logp` only for a rollout's first
   mini-batch. The scope's `reduce_sum` is the only communication.
2. `__call__(batch, cfg)`, per micro-batch, returns `LossOutput(loss_sum, num_tokens, metrics)`
   in Megatron's `calculate_per_token_loss` form: the trainer divides the global sum of
   `loss_sum` by the global sum of `num_tokens` (see `aggregation.py`).

Per-token surrogate (DESIGN section 1), rho = exp(clamp(l - l_old, +-log_ratio_clamp)); with
`tis_cap` set, the surrogate (not the KL term) is multiplied by the truncated importance weight
min(exp(l_old - l_rollout), C) of `rollout_correction.py`; KL is `kl.kl_term`:

    grpo      x = -min(rho A,  clip(rho, 1-eps_low, 1+eps_high) A)  + beta KL
    cw_grpo   x = -min(rho A^, clip(rho, 1-eps_low, 1+eps_high) A^) + beta KL,   A^ = w~ A
    clip_cov  as grpo, but the gradient of a random `ratio` share of the tokens whose
              covariance c lies in (lb, ub), and whose gradient no clip has already cut, is
              detached                                                      (Cui et al. 2025)
    kl_cov    x = -rho A + coef |log rho| on exactly the k = max(1, floor(ratio N)) tokens of
              largest c, x = -rho A elsewhere (no ratio clipping)            (Cui et al. 2025)

A loss's own settings are its constructor's keyword arguments (algo.options.<name>:
`build_policy_loss`); the settings every loss shares are `AlgoConfig`'s.

With dual-clip (`clip_ratio_c` = C > 1, Ye et al. 2020) the clipped surrogate of a token with
A < 0 is further bounded, x = min(x, -C A), so that an exploding rho cannot make it unbounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from cwgrpo_megatron.algo.aggregation import get_loss_aggregation
from cwgrpo_megatron.algo.covariance import CovarianceStats, centred_covariance, kernel_weights
from cwgrpo_megatron.algo.draws import token_uniform
from cwgrpo_megatron.algo.kl import kl_term
from cwgrpo_megatron.algo.metrics import (
    Metrics,
    covariance_metrics,
    effective_covariance_metrics,
    mean_metric,
    weight_metrics,
)
from cwgrpo_megatron.algo.names import POLICY_LOSSES
from cwgrpo_megatron.algo.rollout_correction import rollout_gap_metrics, truncated_is_weight
from cwgrpo_megatron.algo.scope import Scope
from cwgrpo_megatron.common.settings import check_range

if TYPE_CHECKING:
    from cwgrpo_megatron.algo.config import AlgoConfig


@dataclass(kw_only=True)
class PolicyBatch:
    """One micro-batch of the training pass; every tensor is `[b, s]`."""

    logp: Tensor
    """Log-probs of the current policy at the sampling temperature (with gradient)."""
    old_logp: Tensor
    """Log-probs of the policy before this rollout's first update, rho's denominator
    (forward-only pass, detached)."""
    advantages: Tensor
    """Per-token advantage A_i, zero outside the mask."""
    mask: Tensor
    """1 on response tokens that count, 0 on prompt and padding."""
    token_stat: Tensor | None = None
    """The slice of `prepare`'s output for these rows (None for grpo)."""
    ref_logp: Tensor | None = None
    """Reference-policy log-probs, needed when kl_beta > 0."""
    entropy: Tensor | None = None
    """Per-token entropy, only for metrics."""
    rollout_logp: Tensor | None = None
    """The engine's sampling log-probs; enables the gap metrics and, with `cfg.tis_cap`, the
    truncated importance weight."""


class LossOutput(NamedTuple):
    loss_sum: Tensor
    num_tokens: Tensor
    metrics: Metrics


class Prepared(NamedTuple):
    token_stat: Tensor | None
    metrics: Metrics


class PolicyLoss:
    """Base class: GRPO's clipped surrogate. Its statistics pass computes the covariance c for
    the diagnostics alone (`covariance_metrics`; 2 `reduce_sum` calls), so that GRPO and
    CW-GRPO runs log the same cw/sigma and cw/top1pct_cov_share."""

    name = "grpo"
    uses_token_stat = False
    """Whether `token_loss` reads `prepare`'s token_stat, so the statistics must exist before
    the update. When it does not, `prepare` yields diagnostics only, and a step of one
    mini-batch runs it after the training pass on that pass's detached log-probs
    (`needs_policy_pass`). A subclass that defines its own `prepare` reads token_stat unless
    it sets this to False."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "prepare" in vars(cls) and "uses_token_stat" not in vars(cls):
            cls.uses_token_stat = True

    def prepare(
        self,
        policy_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        scope: Scope,
        cfg: AlgoConfig,
        old_logp: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Prepared:
        """Per-token constants for the mini-batch about to be trained on; all tensors `[b, s]`.

        `policy_logp`: detached log-probs of the policy being updated (the statistics' l);
        `old_logp`: those of the policy that sampled (rho's denominator). None means they are
        the same, as in a rollout's first mini-batch.
        """
        stats = centred_covariance(policy_logp, advantages, mask, scope)
        return Prepared(None, covariance_metrics(stats, mask))

    def token_loss(self, batch: PolicyBatch, cfg: AlgoConfig) -> tuple[Tensor, Tensor, Metrics]:
        """(per-token loss x, ratio rho, loss-specific metrics); tensors are `[b, s]`."""
        surrogate = clipped_surrogate(batch, batch.advantages, cfg)
        return surrogate.loss, surrogate.ratio, surrogate.metrics

    def __call__(self, batch: PolicyBatch, cfg: AlgoConfig) -> LossOutput:
        per_token, ratio, metrics = self.token_loss(batch, cfg)
        count = batch.mask.to(torch.float64).sum()
        if batch.rollout_logp is not None:
            metrics.update(
                rollout_gap_metrics(batch.old_logp, batch.rollout_logp, batch.mask, count)
            )
            if cfg.tis_cap is not None:
                tis = truncated_is_weight(batch.old_logp, batch.rollout_logp, cfg.tis_cap)
                per_token = per_token * tis
                metrics["actor/tis_weight_mean"] = mean_metric(tis, batch.mask, count)
        elif cfg.tis_cap is not None:
            raise ValueError("algo.tis_cap is set but the batch has no rollout log-probs")
        if cfg.kl_beta > 0:
            if batch.ref_logp is None:
                raise ValueError("kl_beta > 0 needs ref_logp from the reference policy")
            kl = kl_term(
                batch.logp,
                batch.ref_logp,
                estimator=cfg.kl_estimator,
                log_ratio_clamp=cfg.log_ratio_clamp,
                kl_clamp=cfg.kl_clamp,
            )
            per_token = per_token + cfg.kl_beta * kl
            metrics["actor/kl"] = mean_metric(kl, batch.mask, count)
        if batch.entropy is not None:
            metrics["actor/entropy"] = mean_metric(batch.entropy, batch.mask, count)
        metrics["actor/ratio_mean"] = mean_metric(ratio, batch.mask, count)
        aggregate = get_loss_aggregation(cfg.loss_agg)
        loss_sum, count = aggregate(per_token, batch.mask, norm_length=cfg.loss_norm_length)
        return LossOutput(loss_sum, count, metrics)


def log_ratio(logp: Tensor, old_logp: Tensor, cfg: AlgoConfig) -> Tensor:
    """log rho = clamp(l - l_old, +-log_ratio_clamp) `[b, s]`; a clamped token gets no gradient
    through it, and exp of it cannot overflow."""
    return (logp - old_logp).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


def policy_ratio(logp: Tensor, old_logp: Tensor, cfg: AlgoConfig) -> Tensor:
    """rho = exp(`log_ratio`) `[b, s]`."""
    return torch.exp(log_ratio(logp, old_logp, cfg))


class Surrogate(NamedTuple):
    """The clipped surrogate of `clipped_surrogate`; tensors are `[b, s]`."""

    loss: Tensor
    ratio: Tensor
    cut: Tensor
    """bool: a clip binds, so the token's surrogate has no gradient."""
    metrics: Metrics


def clip_cuts(ratio: Tensor, adv: Tensor, cfg: AlgoConfig) -> tuple[Tensor, Tensor]:
    """Where the PPO clip binds (clipped < unclipped: rho > 1 + eps_high for adv > 0, rho <
    1 - eps_low for adv < 0), and where dual-clip binds (adv < 0 and max(rho, 1 - eps_low) >
    clip_ratio_c; never when clip_ratio_c is None); bool `[b, s]` each, disjoint."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    ppo = clipped < unclipped
    if cfg.clip_ratio_c is None:
        return ppo, torch.zeros_like(ppo)
    dual = (adv < 0) & (-torch.minimum(unclipped, clipped) > -cfg.clip_ratio_c * adv)
    return ppo, dual


def clipped_surrogate(batch: PolicyBatch, adv: Tensor, cfg: AlgoConfig) -> Surrogate:
    """x = -min(rho adv, clip(rho, 1-eps_low, 1+eps_high) adv), then x = min(x, -C adv) where
    adv < 0 with dual-clip (C = clip_ratio_c); all `[b, s]`.

    Metrics are shares of all counted tokens where a clip cuts the gradient:
    `actor/clip_frac_high` (adv > 0, rho > 1 + eps_high), `actor/clip_frac_low` (adv < 0,
    rho < 1 - eps_low) and, with dual-clip, `actor/clip_frac_dual` (adv < 0, rho > C; verl's
    pg_clipfrac_lower).
    """
    ratio = policy_ratio(batch.logp, batch.old_logp, cfg)
    per_token = -torch.minimum(
        ratio * adv, ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    )
    ppo, dual = clip_cuts(ratio.detach(), adv, cfg)
    count = batch.mask.to(torch.float64).sum()
    metrics = {
        "actor/clip_frac_high": mean_metric((ppo & (adv > 0)).to(adv.dtype), batch.mask, count),
        "actor/clip_frac_low": mean_metric((ppo & (adv < 0)).to(adv.dtype), batch.mask, count),
    }
    if cfg.clip_ratio_c is not None:
        per_token = torch.where(dual, -cfg.clip_ratio_c * adv, per_token)
        metrics["actor/clip_frac_dual"] = mean_metric(dual.to(adv.dtype), batch.mask, count)
    return Surrogate(per_token, ratio, ppo | dual, metrics)


def register_policy_loss(name: str):
    """Class decorator: registers the class under `name`; its constructor's keyword arguments
    are the loss's options (algo.options.<name>)."""

    def decorator(cls: type[PolicyLoss]) -> type[PolicyLoss]:
        cls.name = name
        POLICY_LOSSES.register(name)(cls)
        return cls

    return decorator


def get_policy_loss(name: str, **options) -> PolicyLoss:
    """A new instance of loss `name`, built with `options`."""
    return POLICY_LOSSES.get(name)(**options)


def build_policy_loss(cfg: AlgoConfig) -> PolicyLoss:
    """algo.policy_loss built from algo.options.<name>, for built-in and plugin losses alike;
    a bad option is a ValueError naming the key."""
    name = cfg.policy_loss
    try:
        return get_policy_loss(name, **cfg.options.get(name, {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"algo.options.{name}: {err}") from err


def needs_policy_pass(cfg: AlgoConfig, mini_batches: int) -> bool:
    """Whether a step runs a forward-only pass of the policy over its rollout batch before the
    first update.

    Mini-batch k > 0 needs it for rho's denominator l_old (the policy before the first update,
    which its training pass no longer is). With one mini-batch, that training pass is the
    policy before the update: its detached log-probs are l_old (rho = 1 in value, as in TRL
    and verl on-policy), and the statistics come from them after the pass, or from the engine
    (`algo.stats_logp=rollout`), unless the loss reads token_stat and they are the trainer's.
    """
    if mini_batches > 1:
        return True
    return cfg.stats_logp == "trainer" and POLICY_LOSSES.get(cfg.policy_loss).uses_token_stat


def _require_stat(batch: PolicyBatch, name: str) -> Tensor:
    if batch.token_stat is None:
        raise ValueError(f"{name} needs batch.token_stat: run prepare() on the step's batch first")
    return batch.token_stat


register_policy_loss("grpo")(PolicyLoss)


@register_policy_loss("cw_grpo")
class CovarianceWeightedLoss(PolicyLoss):
    """CW-GRPO: the advantage of each token is scaled by its kernel weight w~ (a constant)."""

    def prepare(self, policy_logp, advantages, mask, *, scope, cfg, old_logp=None, generator=None):
        stats = centred_covariance(policy_logp, advantages, mask, scope)
        weights = kernel_weights(stats, mask, scope)
        metrics = {
            **covariance_metrics(stats, mask),
            **weight_metrics(weights, mask),
            **effective_covariance_metrics(weights, stats.cov, mask),
        }
        return Prepared(weights, metrics)

    def token_loss(self, batch, cfg):
        weights = _require_stat(batch, self.name).detach()
        surrogate = clipped_surrogate(batch, weights * batch.advantages, cfg)
        return surrogate.loss, surrogate.ratio, surrogate.metrics


@register_policy_loss("clip_cov")
class ClipCovLoss(PolicyLoss):
    """Clip-Cov: detach the gradient of a random few tokens of high covariance.

    The eligible band holds the counted tokens with c in (lb, ub) whose gradient no clip cuts
    already at rho = exp(l_policy - l_old) (`clip_cuts`; as Cui et al. and verl, detaching
    those would remove nothing). Each is picked with probability p = min(1, k / n_band), where
    k = max(1, floor(ratio N)) and n_band are pool sums, so k tokens are picked in expectation
    over the whole pool (Cui et al. pick exactly k with a permutation; a Bernoulli draw needs
    only sums, so it composes across ranks). Each token's uniform draw is a hash of its global
    position and a key drawn from `generator` (`draws.token_uniform`), so with the generator
    seeded the same on every rank a token is picked or not whatever the layout.
    `actor/clip_cov_frac` counts the picked tokens whose gradient the training pass actually
    removes.
    Communication: 3 `reduce_sum` calls.

    Options: `ratio` (the share of the pool's tokens whose gradient is detached, 2e-4), `lb`
    and `ub` (the covariance band eligible for it, (1, 5)).
    """

    def __init__(self, *, ratio: float = 2e-4, lb: float = 1.0, ub: float = 5.0) -> None:
        check_range("ratio", ratio, low=0.0, high=1.0)
        if not lb < ub:
            raise ValueError(f"the band's lb={lb} must be below ub={ub}")
        self.ratio, self.lb, self.ub = ratio, lb, ub

    def prepare(self, policy_logp, advantages, mask, *, scope, cfg, old_logp=None, generator=None):
        if generator is None:
            raise ValueError("clip_cov needs a torch.Generator seeded the same on every rank")
        stats = centred_covariance(policy_logp, advantages, mask, scope)
        band = (mask > 0) & (stats.cov > self.lb) & (stats.cov < self.ub)
        if old_logp is not None:
            ppo, dual = clip_cuts(policy_ratio(policy_logp, old_logp, cfg), advantages, cfg)
            band &= ~(ppo | dual)
        band_count = scope.sums(band.to(stats.cov.dtype))[:, 0]
        target = torch.floor(self.ratio * stats.count).clamp(min=1.0)
        prob = (target / band_count.clamp(min=1.0)).clamp(max=1.0)
        key = torch.randint(0, 2**31, (), generator=generator, device=generator.device)
        uniform = token_uniform(scope.token_order(mask.shape[-1]).to(mask.device), key)
        detached = band & (uniform < scope.per_token(prob))
        return Prepared((~detached).to(torch.float32), covariance_metrics(stats, mask))

    def token_loss(self, batch, cfg):
        keep = _require_stat(batch, self.name) > 0
        surrogate = clipped_surrogate(batch, batch.advantages, cfg)
        removed = ~keep & ~surrogate.cut
        metrics = dict(surrogate.metrics)
        metrics["actor/clip_cov_frac"] = mean_metric(removed.to(torch.float32), batch.mask)
        loss = torch.where(keep, surrogate.loss, surrogate.loss.detach())
        return loss, surrogate.ratio, metrics


@register_policy_loss("kl_cov")
class KLCovLoss(PolicyLoss):
    """KL-Cov: a |log rho| penalty on exactly k = max(1, floor(ratio N)) tokens of each pool,
    those of largest c.

    Ties are broken by token order: when several tokens share the k-th largest c (in a pool
    where every advantage is equal, c = 0 on every token), the tied ones that come first in
    the global batch (`Scope.token_order`: row, then position) are taken, so the selection
    has exactly k tokens, is deterministic, and is the same at every layout. Both searches run
    on pool counts (`kth_largest`), so they are exact across ranks with only sums:
    2 + 22 + 1 + 18 `reduce_sum` calls of at most 7 scalars per pool, once per step.

    Options: `ratio` (the share of the pool's tokens penalised, 2e-3) and `coef` (the weight
    of |log rho| on them, 1).
    """

    def __init__(self, *, ratio: float = 2e-3, coef: float = 1.0) -> None:
        check_range("ratio", ratio, low=0.0, high=1.0)
        check_range("coef", coef, low=0.0)
        self.ratio, self.coef = ratio, coef

    def prepare(self, policy_logp, advantages, mask, *, scope, cfg, old_logp=None, generator=None):
        stats = centred_covariance(policy_logp, advantages, mask, scope)
        k = torch.where(
            stats.count > 0,
            torch.floor(self.ratio * stats.count).clamp(min=1.0),
            torch.zeros_like(stats.count),
        )
        selected = top_k_tokens(stats, mask, k, scope)
        metrics = covariance_metrics(stats, mask)
        metrics["actor/kl_cov_frac"] = mean_metric(selected.to(torch.float32), mask)
        return Prepared(selected.to(torch.float32), metrics)

    def token_loss(self, batch, cfg):
        selected = _require_stat(batch, self.name)
        log_rho = log_ratio(batch.logp, batch.old_logp, cfg)
        ratio = torch.exp(log_rho)
        penalty = self.coef * log_rho.abs()
        return -ratio * batch.advantages + selected * penalty, ratio, {}


_SEARCH_PROBES = 7
_SEARCH_ROUNDS = 22  # 8**22 > 2**64: the bracket shrinks below float64 resolution
_ORDER_ROUNDS = 18  # 8**18 > 2**53: token orders are integers below 2**53
_MAX_ORDER = float(2**53)


def _bracket_search(
    values: Tensor, eligible: Tensor, k: Tensor, lo: Tensor, hi: Tensor, scope: Scope, rounds: int
) -> tuple[Tensor, Tensor]:
    """Shrinks per-pool brackets `[K]` that keep #{v >= lo} >= k > #{v >= hi} over the eligible
    tokens (`values, eligible [b, s]`). Each round counts the tokens at or above 7 probes with
    one `reduce_sum` and keeps the sub-interval that holds the k-th largest value."""
    fractions = torch.arange(1, _SEARCH_PROBES + 1, dtype=torch.float64, device=lo.device)
    fractions = fractions / (_SEARCH_PROBES + 1)
    for _ in range(rounds):
        probes = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * fractions  # [K, P]
        token_probes = probes[scope.segment]  # [b, P]
        columns = [
            (eligible & (values >= token_probes[:, j : j + 1])).to(torch.float64)
            for j in range(_SEARCH_PROBES)
        ]
        counts = scope.sums(*columns)  # [K, P]
        enough = counts >= k.unsqueeze(-1)  # monotone: True then False along P
        below = enough.sum(dim=-1)  # number of probes still at or below the k-th value
        idx = (below - 1).clamp(min=0)
        new_lo = torch.where(below > 0, probes.gather(-1, idx.unsqueeze(-1)).squeeze(-1), lo)
        upper_idx = below.clamp(max=_SEARCH_PROBES - 1)
        upper = probes.gather(-1, upper_idx.unsqueeze(-1)).squeeze(-1)
        hi = torch.where(below < _SEARCH_PROBES, upper, hi)
        lo = new_lo
    return lo, hi


def _kth_bracket(stats: CovarianceStats, mask: Tensor, k: Tensor, scope: Scope):
    # Every counted c lies in [c_bar - sigma sqrt(N), c_bar + sigma sqrt(N)], which brackets the
    # search without a min/max reduction; c is rounded to its dtype, so a value may sit a few
    # ulps outside the exact bracket.
    cov = stats.cov
    radius = stats.cov_std * stats.count.sqrt()
    margin = 8 * torch.finfo(cov.dtype).eps * (1.0 + stats.cov_mean.abs() + radius)
    lo = stats.cov_mean - radius - margin
    hi = stats.cov_mean + radius + margin
    return _bracket_search(cov, mask > 0, k, lo, hi, scope, _SEARCH_ROUNDS)


def kth_largest(stats: CovarianceStats, mask: Tensor, k: Tensor, scope: Scope) -> Tensor:
    """Per pool `[K]`, the largest t with #{c >= t} >= k, to the resolution of c's dtype."""
    return _kth_bracket(stats, mask, k, scope)[0]


def top_k_tokens(stats: CovarianceStats, mask: Tensor, k: Tensor, scope: Scope) -> Tensor:
    """bool `[b, s]`: exactly k `[K]` counted tokens per pool (all of them when k exceeds the
    pool): every c above the k-th largest value c_(k), then the ties at c_(k) in token order.

    After the search, [lo, hi) holds c_(k) and no other value of c, so c >= hi are the tokens
    strictly above it; among the ties, the (k - #above) of smallest order are the ones whose
    negated order is at or above the (k - #above)-th largest negated order.
    """
    lo, hi = _kth_bracket(stats, mask, k, scope)
    counted = mask > 0
    above = counted & (stats.cov >= scope.per_token(hi))
    tied = counted & (stats.cov >= scope.per_token(lo)) & ~above
    wanted = k - scope.sums(above.to(torch.float64))[:, 0]
    negated_order = -scope.token_order(mask.shape[-1]).to(mask.device)
    first, _ = _bracket_search(
        negated_order,
        tied,
        wanted,
        torch.full_like(wanted, -_MAX_ORDER),
        torch.ones_like(wanted),
        scope,
        _ORDER_ROUNDS,
    )
    return above | (tied & (negated_order >= scope.per_token(first)))
