"""Policy losses behind one interface (pure tensor code).

Every loss works in two phases:

1. `prepare(old_logp, advantages, mask, scope=..., cfg=...)`, once per optimizer step on the
   detached log-probs of the policy being updated (the forward-only pass), computes a per-token
   constant `token_stat [b, s]` from scope statistics (e.g. CW-GRPO's w~). The scope's
   `reduce_sum` is the only communication.
2. `__call__(batch, cfg)`, per micro-batch, returns `LossOutput(loss_sum, num_tokens, metrics)`
   in Megatron's `calculate_per_token_loss` form: the trainer divides the global sum of
   `loss_sum` by the global sum of `num_tokens` (see `aggregation.py`).

Per-token surrogate (DESIGN section 1), rho = exp(l - l_old); with `tis_cap` set, the surrogate
(not the KL term) is multiplied by the truncated importance weight min(exp(l_old - l_rollout), C)
of `rollout_correction.py`:

    grpo      x = -min(rho A,  clip(rho, 1-eps_low, 1+eps_high) A)  + beta KL
    cw_grpo   x = -min(rho A^, clip(rho, 1-eps_low, 1+eps_high) A^) + beta KL,   A^ = w~ A
    clip_cov  as grpo, but the gradient of a random `clip_cov_ratio` share of the tokens whose
              covariance c lies in (clip_cov_lb, clip_cov_ub) is detached   (Cui et al. 2025)
    kl_cov    x = -rho A + kl_cov_coef |l - l_old| on the `kl_cov_ratio` share of tokens of
              largest c, x = -rho A elsewhere (no ratio clipping)          (Cui et al. 2025)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from cwgrpo_megatron.algo.aggregation import get_loss_aggregation
from cwgrpo_megatron.algo.covariance import CovarianceStats, centred_covariance, kernel_weights
from cwgrpo_megatron.algo.kl import get_kl_estimator
from cwgrpo_megatron.algo.metrics import (
    Metrics,
    covariance_metrics,
    mean_metric,
    weight_metrics,
)
from cwgrpo_megatron.algo.rollout_correction import rollout_gap_metrics, truncated_is_weight
from cwgrpo_megatron.algo.scope import Scope
from cwgrpo_megatron.registry import Registry

if TYPE_CHECKING:
    from cwgrpo_megatron.config import AlgoConfig


@dataclass(kw_only=True)
class PolicyBatch:
    """One micro-batch of the training pass; every tensor is `[b, s]`."""

    logp: Tensor
    """Log-probs of the current policy at the sampling temperature (with gradient)."""
    old_logp: Tensor
    """Log-probs of the policy that produced the statistics (forward-only pass, detached)."""
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
    """Base class: GRPO's clipped surrogate, no statistics pass."""

    name = "grpo"

    def prepare(
        self,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        scope: Scope,
        cfg: AlgoConfig,
        generator: torch.Generator | None = None,
    ) -> Prepared:
        return Prepared(None, {})

    def token_loss(self, batch: PolicyBatch, cfg: AlgoConfig) -> tuple[Tensor, Tensor, Metrics]:
        """(per-token loss x, ratio rho, loss-specific metrics); tensors are `[b, s]`."""
        return clipped_surrogate(batch, batch.advantages, cfg)

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
                metrics["tis_weight_mean"] = mean_metric(tis, batch.mask, count)
        elif cfg.tis_cap is not None:
            raise ValueError("algo.tis_cap is set but the batch has no rollout log-probs")
        if cfg.kl_beta > 0:
            if batch.ref_logp is None:
                raise ValueError("kl_beta > 0 needs ref_logp from the reference policy")
            kl = get_kl_estimator(cfg.kl_estimator)(batch.logp, batch.ref_logp)
            per_token = per_token + cfg.kl_beta * kl
            metrics["kl_mean"] = mean_metric(kl, batch.mask, count)
        if batch.entropy is not None:
            metrics["entropy_mean"] = mean_metric(batch.entropy, batch.mask, count)
        metrics["ratio_mean"] = mean_metric(ratio, batch.mask, count)
        aggregate = get_loss_aggregation(cfg.loss_agg)
        loss_sum, count = aggregate(per_token, batch.mask, norm_length=cfg.loss_norm_length)
        return LossOutput(loss_sum, count, metrics)


def clipped_surrogate(
    batch: PolicyBatch, adv: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Metrics]:
    """x = -min(rho adv, clip(rho, 1-eps_low, 1+eps_high) adv) `[b, s]`, rho, clip fractions.

    The clip binds (the token's gradient is cut) where clipped < unclipped: at
    rho > 1 + eps_high for adv > 0 (`clip_frac_high`), at rho < 1 - eps_low for adv < 0
    (`clip_frac_low`); both are shares of all counted tokens.
    """
    ratio = torch.exp(batch.logp - batch.old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    binds = clipped < unclipped
    count = batch.mask.to(torch.float64).sum()
    return (
        per_token,
        ratio,
        {
            "clip_frac_high": mean_metric((binds & (adv > 0)).to(adv.dtype), batch.mask, count),
            "clip_frac_low": mean_metric((binds & (adv < 0)).to(adv.dtype), batch.mask, count),
        },
    )


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str):
    """Class decorator: registers one instance of the class under `name`."""

    def decorator(cls: type[PolicyLoss]) -> type[PolicyLoss]:
        cls.name = name
        POLICY_LOSSES.register(name)(cls())
        return cls

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    return POLICY_LOSSES.get(name)


def _require_stat(batch: PolicyBatch, name: str) -> Tensor:
    if batch.token_stat is None:
        raise ValueError(f"{name} needs batch.token_stat: run prepare() on the step's batch first")
    return batch.token_stat


register_policy_loss("grpo")(PolicyLoss)


@register_policy_loss("cw_grpo")
class CovarianceWeightedLoss(PolicyLoss):
    """CW-GRPO: the advantage of each token is scaled by its kernel weight w~ (a constant)."""

    def prepare(self, old_logp, advantages, mask, *, scope, cfg, generator=None):
        stats = centred_covariance(old_logp, advantages, mask, scope)
        weights = kernel_weights(stats, mask, scope)
        return Prepared(weights, {**covariance_metrics(stats), **weight_metrics(weights, mask)})

    def token_loss(self, batch, cfg):
        weights = _require_stat(batch, self.name).detach()
        return clipped_surrogate(batch, weights * batch.advantages, cfg)


@register_policy_loss("clip_cov")
class ClipCovLoss(PolicyLoss):
    """Clip-Cov: detach the gradient of a random few tokens of high covariance.

    Each token with c in (lb, ub) is picked with probability p = min(1, k / n_band), where
    k = max(1, floor(ratio N)) and n_band are pool sums, so k tokens are picked in expectation
    over the whole pool (Cui et al. pick exactly k with a permutation; a Bernoulli draw needs
    only sums, so it composes across ranks). The uniform draws come from `generator`, which must
    be seeded identically on the tensor-parallel ranks of a data-parallel rank so that they pick
    the same tokens. Communication: 3 `reduce_sum` calls.
    """

    def prepare(self, old_logp, advantages, mask, *, scope, cfg, generator=None):
        if generator is None:
            raise ValueError(
                "clip_cov needs a torch.Generator seeded the same on every tensor-parallel rank"
            )
        stats = centred_covariance(old_logp, advantages, mask, scope)
        m = mask > 0
        band = m & (stats.cov > cfg.clip_cov_lb) & (stats.cov < cfg.clip_cov_ub)
        band_count = scope.sums(band.to(stats.cov.dtype))[:, 0]
        target = torch.floor(cfg.clip_cov_ratio * stats.count).clamp(min=1.0)
        prob = (target / band_count.clamp(min=1.0)).clamp(max=1.0)
        uniform = torch.rand(
            mask.shape, generator=generator, dtype=torch.float64, device=generator.device
        )
        detached = band & (uniform.to(mask.device) < scope.per_token(prob))
        keep = (~detached).to(torch.float32)
        metrics = covariance_metrics(stats)
        metrics["clip_cov_frac"] = mean_metric(detached.to(torch.float32), mask)
        return Prepared(keep, metrics)

    def token_loss(self, batch, cfg):
        keep = _require_stat(batch, self.name) > 0
        per_token, ratio, metrics = clipped_surrogate(batch, batch.advantages, cfg)
        return torch.where(keep, per_token, per_token.detach()), ratio, metrics


@register_policy_loss("kl_cov")
class KLCovLoss(PolicyLoss):
    """KL-Cov: a |l - l_old| penalty on the k = max(1, floor(ratio N)) tokens of largest c.

    The k-th largest c of each pool is found by a bracketed multi-way search on pool counts
    (`kth_largest`), so it is exact across ranks with only sums: 2 + 22 `reduce_sum` calls of at
    most 7 scalars per pool, once per step. Ties at the threshold are all selected.
    """

    def prepare(self, old_logp, advantages, mask, *, scope, cfg, generator=None):
        stats = centred_covariance(old_logp, advantages, mask, scope)
        k = torch.where(
            stats.count > 0,
            torch.floor(cfg.kl_cov_ratio * stats.count).clamp(min=1.0),
            torch.zeros_like(stats.count),
        )
        threshold = kth_largest(stats, mask, k, scope)
        selected = (mask > 0) & (stats.cov >= scope.per_token(threshold))
        metrics = covariance_metrics(stats)
        metrics["kl_cov_frac"] = mean_metric(selected.to(torch.float32), mask)
        return Prepared(selected.to(torch.float32), metrics)

    def token_loss(self, batch, cfg):
        selected = _require_stat(batch, self.name)
        ratio = torch.exp(batch.logp - batch.old_logp)
        penalty = cfg.kl_cov_coef * (batch.logp - batch.old_logp).abs()
        return -ratio * batch.advantages + selected * penalty, ratio, {}


_SEARCH_PROBES = 7
_SEARCH_ROUNDS = 22  # 8**22 > 2**64: the bracket shrinks below float64 resolution


def kth_largest(stats: CovarianceStats, mask: Tensor, k: Tensor, scope: Scope) -> Tensor:
    """Per pool `[K]`, the largest t with #{c >= t} >= k, to the resolution of c's dtype.

    Every counted c lies in [c_bar - sigma sqrt(N), c_bar + sigma sqrt(N)], which brackets the
    search without a min/max reduction. Each round counts the tokens at or above 7 probes with
    one `reduce_sum` and keeps the sub-interval that holds the k-th value.
    """
    cov = stats.cov
    radius = stats.cov_std * stats.count.sqrt()
    # c is rounded to its dtype, so a value may sit a few ulps outside the exact bracket
    margin = 8 * torch.finfo(cov.dtype).eps * (1.0 + stats.cov_mean.abs() + radius)
    lo = stats.cov_mean - radius - margin
    hi = stats.cov_mean + radius + margin
    fractions = torch.arange(1, _SEARCH_PROBES + 1, dtype=torch.float64) / (_SEARCH_PROBES + 1)
    in_pool = mask > 0
    for _ in range(_SEARCH_ROUNDS):
        probes = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * fractions  # [K, P]
        token_probes = probes[scope.segment]  # [b, P]
        columns = [
            (in_pool & (cov >= token_probes[:, j : j + 1])).to(cov.dtype)
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
    return lo
