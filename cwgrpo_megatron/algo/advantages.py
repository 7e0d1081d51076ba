"""Group-relative advantages (pure tensor code).

GRPO:     A_i = (r_i - mean_g r) / (std_g r + eps)
Dr.GRPO:  A_i =  r_i - mean_g r                     (std_normalize=False)

std_g is the unbiased sample std of the G rewards of a prompt, as in TRL and verl; a group of
size 1 has no spread and gets A = 0. A group whose rewards are all equal has A = 0.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from cwgrpo_megatron.algo.names import ADVANTAGE_ESTIMATORS

AdvantageEstimator = Callable[..., Tensor]
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get


@register_advantage_estimator("grpo")
def group_advantages(rewards: Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages of `rewards [P, G]` (P prompts x G responses), returned as `[P, G]` float32.

    Statistics are taken in float64 so that rewards that differ only in low bits (e.g. length
    penalties) still give exact zeros when equal.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group_size], got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    centred = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        group_size = r.shape[1]
        if group_size > 1:
            std = r.std(dim=1, keepdim=True, correction=1)
        else:
            std = torch.zeros_like(r[:, :1])
        centred = centred / (std + eps)
    return centred.to(torch.float32)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence `advantages [b]` -> per-token `[b, s]`, zero where `mask [b, s]` is 0."""
    return advantages.to(torch.float32).unsqueeze(-1) * mask.to(torch.float32)
