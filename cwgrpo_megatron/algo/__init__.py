"""Pure tensor math of CW-GRPO: no torch.distributed, no megatron, no host syncs.

Global statistics come in through a `Scope` (whose `reduce_sum` the comm package supplies) or
as arguments; every function here runs unchanged in one process.
"""

from cwgrpo_megatron.algo.advantages import broadcast_to_tokens, group_advantages
from cwgrpo_megatron.algo.covariance import (
    CovarianceStats,
    centred_covariance,
    covariance_weights,
    kernel_weights,
)
from cwgrpo_megatron.algo.losses import (
    LossOutput,
    PolicyBatch,
    PolicyLoss,
    build_policy_loss,
    get_policy_loss,
    needs_policy_pass,
    register_policy_loss,
)
from cwgrpo_megatron.algo.scope import Scope

__all__ = [
    "CovarianceStats",
    "LossOutput",
    "PolicyBatch",
    "PolicyLoss",
    "Scope",
    "broadcast_to_tokens",
    "build_policy_loss",
    "centred_covariance",
    "covariance_weights",
    "get_policy_loss",
    "group_advantages",
    "kernel_weights",
    "needs_policy_pass",
    "register_policy_loss",
]
