"""Per-token KL estimators of KL(pi_theta || pi_ref) from sampled tokens (Schulman, 2020).

With log r = l_ref - l (both [b, s]):
    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased, low variance
    k3 = (r - 1) - log r         unbiased, >= 0 (GRPO's choice)
"""

from collections.abc import Callable

import torch
from torch import Tensor

from cwgrpo_megatron.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
get_kl_estimator = KL_ESTIMATORS.get


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (ref_logp - logp).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    log_ratio = ref_logp - logp
    return torch.expm1(log_ratio) - log_ratio
