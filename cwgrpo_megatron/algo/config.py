"""The algorithm's settings (DESIGN section 1): loss, advantages, scopes, clipping, KL."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from cwgrpo_megatron.algo.names import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    SCOPE_NAMES,
    STATS_LOGP,
)
from cwgrpo_megatron.common.settings import check_choice, check_options, check_range


@dataclass(kw_only=True, frozen=True)
class AlgoConfig:
    """The policy-gradient algorithm (DESIGN section 1): what every loss shares, and each
    loss's own options."""

    MOVED: ClassVar[dict[str, str]] = {
        "clip_cov_ratio": "algo.options.clip_cov.ratio",
        "clip_cov_lb": "algo.options.clip_cov.lb",
        "clip_cov_ub": "algo.options.clip_cov.ub",
        "kl_cov_ratio": "algo.options.kl_cov.ratio",
        "kl_cov_coef": "algo.options.kl_cov.coef",
    }
    """Keys of earlier versions -> where their value goes now (`config.load_config` names it)."""

    policy_loss: str = "cw_grpo"
    """Policy loss: grpo, cw_grpo, clip_cov or kl_cov."""
    advantage_estimator: str = "grpo"
    """Group advantage estimator (registry name)."""
    adv_std_normalize: bool = True
    """Divide group-centred rewards by the group std (GRPO); false gives Dr.GRPO advantages."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    cov_scope: str = "global"
    """Token pool of the covariance statistics: global, group or micro_batch (layout-dependent)."""
    stats_logp: str = "trainer"
    """The log-probs l of the covariance statistics (cw_grpo's c and sigma, clip_cov's and
    kl_cov's selections, the cw/* diagnostics): trainer (the policy being updated, from the
    trainer: a forward-only pass before the update when the loss reads them) or rollout (the
    engine's sampling log-probs of the same policy, so no pass; refused with
    rollout.async_steps=1, top_p < 1, top_k > 0 or train.ppo_mini_batches > 1, where they are
    not that policy's: docs/design.md, "Which log-probs")."""
    clip_eps_low: float = 0.2
    """PPO ratio clip below: rho >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """PPO ratio clip above: rho <= 1 + clip_eps_high."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO (grpo, cw_grpo, clip_cov): a token with A < 0 has loss at most -A * C,
    however large rho grows. None disables it; verl's default is 3. Must be > 1."""
    log_ratio_clamp: float = 20.0
    """log rho = l - l_old and the KL log ratio l_ref - l are clamped to +- this before exp
    (as verl); a clamped token gets no gradient through it. The default never binds in a
    healthy run (rho = e^20)."""
    kl_clamp: float = 10.0
    """Each token's KL estimate is clamped to +- this (verl clamps k3 to 10), so that one
    token the reference model rates far higher cannot spike the loss."""
    kl_beta: float = 0.0
    """Weight of the KL term to the reference policy; 0 disables the reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3."""
    loss_agg: str = "token-mean"
    """Aggregation over the global mini-batch: token-mean, seq-mean-token-mean,
    seq-mean-token-sum-norm."""
    loss_norm_length: int | None = None
    """Constant length L of seq-mean-token-sum-norm (Dr.GRPO): set it to the max response tokens."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """{loss name: {option: value}}, the keyword arguments of that loss's constructor, checked
    against its signature: clip_cov {ratio: 2e-4 (share of the pool's tokens whose gradient
    is detached), lb: 1.0, ub: 5.0 (the covariance band eligible)}, kl_cov {ratio: 2e-3 (share
    of the pool's tokens, those of largest covariance, given the penalty), coef: 1.0 (of
    |logp - old_logp|)} (Cui et al. 2025), or a plugin loss's own (docs/extending.md)."""
    tis_cap: float | None = None
    """Truncated importance sampling for the rollout / trainer mismatch: each token's surrogate
    is multiplied by min(exp(l_old - l_rollout), tis_cap). None disables it; typical: 2."""

    def __post_init__(self) -> None:
        check_choice("algo.policy_loss", self.policy_loss, POLICY_LOSSES.names())
        check_choice(
            "algo.advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS.names()
        )
        check_choice("algo.cov_scope", self.cov_scope, SCOPE_NAMES)
        check_choice("algo.stats_logp", self.stats_logp, STATS_LOGP)
        check_choice("algo.kl_estimator", self.kl_estimator, KL_ESTIMATORS.names())
        check_choice("algo.loss_agg", self.loss_agg, LOSS_AGGREGATIONS.names())
        check_range("algo.adv_eps", self.adv_eps, low=0.0)
        check_range("algo.clip_eps_low", self.clip_eps_low, low=0.0, high=1.0)
        check_range("algo.clip_eps_high", self.clip_eps_high, low=0.0)
        check_range("algo.kl_beta", self.kl_beta, low=0.0)
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"algo.clip_ratio_c={self.clip_ratio_c} must be > 1 (the dual-clip bound on rho "
                "for negative advantages; verl uses 3), or null to disable dual-clip"
            )
        if self.clip_ratio_c is not None and self.policy_loss == "kl_cov":
            raise ValueError(
                "algo.clip_ratio_c does nothing with policy_loss=kl_cov, which does not clip the "
                "ratio; remove it or choose grpo, cw_grpo or clip_cov"
            )
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"algo.log_ratio_clamp={self.log_ratio_clamp} must be > 0")
        if not self.kl_clamp > 0:
            raise ValueError(f"algo.kl_clamp={self.kl_clamp} must be > 0")
        # a loss's options may stay in a recipe that an overlay switches away from
        for name in dict.fromkeys([*self.options, self.policy_loss]):
            check_choice("algo.options key", name, POLICY_LOSSES.names())
            options, loss = self.options.get(name, {}), POLICY_LOSSES.get(name)
            check_options(f"algo.options.{name}", "policy loss", name, loss, options)
        if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_norm_length is None:
            raise ValueError(
                "algo.loss_agg=seq-mean-token-sum-norm needs algo.loss_norm_length: "
                "set it to the maximum number of response tokens"
            )
        if self.loss_norm_length is not None:
            check_range("algo.loss_norm_length", self.loss_norm_length, low=1)
        if self.tis_cap is not None:
            check_range("algo.tis_cap", self.tis_cap, low=1.0)
