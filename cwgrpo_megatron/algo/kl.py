"""Per-token KL estimators of KL(pi_theta || pi_ref) from sampled tokens (Schulman, 2020).

Each estimator is a function of the per-token log ratio x = log r = l_ref - l `[b, s]`:
    k1 = -x                      unbiased, high variance, can be negative
    k2 = x^2 / 2                 biased, low variance
    k3 = (r - 1) - x             unbiased, >= 0 (GRPO's choice); computed as expm1(x) - x,
                                 which keeps its relative accuracy near the policy (x -> 0)

The loss bounds both sides (`kl_term`): x is clamped to +-`log_ratio_clamp` before the estimator,
so exp cannot overflow (an inf there would turn the clamp's zero gradient into NaN), and the
estimate to +-`kl_clamp`, so that one token the reference rates far higher cannot spike the
loss. A clamped token gets no KL gradient; where neither clamp binds the values are unchanged.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from cwgrpo_megatron.algo.names import KL_ESTIMATORS

KLEstimator = Callable[[Tensor], Tensor]
get_kl_estimator = KL_ESTIMATORS.get


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: Tensor) -> Tensor:
    return -log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: Tensor) -> Tensor:
    return torch.expm1(log_ratio) - log_ratio


def kl_term(
    logp: Tensor, ref_logp: Tensor, *, estimator: str, log_ratio_clamp: float, kl_clamp: float
) -> Tensor:
    """clamp(k(clamp(l_ref - l, +-log_ratio_clamp)), +-kl_clamp) `[b, s]`."""
    log_ratio = (ref_logp - logp).clamp(-log_ratio_clamp, log_ratio_clamp)
    return get_kl_estimator(estimator)(log_ratio).clamp(-kl_clamp, kl_clamp)
