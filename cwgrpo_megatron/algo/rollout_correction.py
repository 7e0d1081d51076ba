"""Rollout / trainer mismatch: the truncated importance weight and the log-prob gap (pure).

The engine samples from pi_rollout (its own kernels, and top-k / top-p truncation when set); the
loss is built on l_old, the trainer's log-probs of the same tokens. Truncated importance
sampling reweights each token's surrogate by

    w_it = min(exp(l_old_it - l_rollout_it), C)          (a constant: no gradient)

so that the update follows pi_old in expectation while a token the engine over-sampled cannot
dominate (C bounds the variance). Shapes: every tensor `[b, s]`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cwgrpo_megatron.algo.metrics import Metrics, extreme_metric, mean_metric


def truncated_is_weight(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """min(exp(l_old - l_rollout), cap), detached."""
    return torch.exp(old_logp.detach() - rollout_logp).clamp(max=cap)


def rollout_gap_metrics(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, count: Tensor | None = None
) -> Metrics:
    """Mean and max of |l_old - l_rollout| over the counted tokens."""
    gap = (old_logp.detach() - rollout_logp).abs()
    return {
        "rollout/gap_mean": mean_metric(gap, mask, count),
        "rollout/gap_max": extreme_metric(gap, mask, "max"),
    }
