"""A loss with a setting: GRPO with each sequence's advantage clipped to [-max_abs, max_abs].

    run.plugins: [examples/plugins/seq_clip_grpo.py]
    algo.policy_loss: seq_clip_grpo
    algo.options: {seq_clip_grpo: {max_abs: 1.5}}

A group advantage is one value per completion, broadcast over its tokens, so clamping it per
token clamps it per sequence. The clipped surrogate, the KL term and the aggregation are the
built-in GRPO's (`PolicyLoss`); actor/adv_clip_frac is the share of tokens whose sequence was
clipped. Pure tensor code, as every loss: it runs unchanged at any TP x PP x DP layout.
"""

import torch

from cwgrpo_megatron.algo import PolicyLoss, register_policy_loss
from cwgrpo_megatron.algo.losses import clipped_surrogate
from cwgrpo_megatron.algo.metrics import mean_metric


@register_policy_loss("seq_clip_grpo")
class SeqClipGRPO(PolicyLoss):
    def __init__(self, *, max_abs: float = 2.0) -> None:
        if not max_abs > 0:
            raise ValueError(f"max_abs={max_abs} must be > 0")
        self.max_abs = max_abs

    def token_loss(self, batch, cfg):
        clipped = batch.advantages.clamp(-self.max_abs, self.max_abs)
        surrogate = clipped_surrogate(batch, clipped, cfg)
        cut = (clipped != batch.advantages).to(torch.float32)
        metrics = {**surrogate.metrics, "actor/adv_clip_frac": mean_metric(cut, batch.mask)}
        return surrogate.loss, surrogate.ratio, metrics
