"""Loss aggregation in the (loss_sum, count) form of Megatron's `calculate_per_token_loss`.

Each aggregation returns a local numerator and a local count; the trainer divides the sum of
numerators over every rank and micro-batch by the sum of counts, so the loss is a mean over the
GLOBAL mini-batch whatever the layout. With per-token loss x, mask m and n_i = sum_t m_it:

    token-mean               sum_it m x / sum_it m                         count = tokens
    seq-mean-token-mean      sum_i (sum_t m x / n_i) / #{i: n_i > 0}       count = sequences
    seq-mean-token-sum-norm  sum_i (sum_t m x / L) / #{i: n_i > 0}         count = sequences
                             (Dr.GRPO; L = loss_norm_length, a constant, never the padded length)

Rows without any counted token (padding rows) contribute nothing and are not counted.
"""

from collections.abc import Callable

from torch import Tensor

from cwgrpo_megatron.algo.names import LOSS_AGGREGATIONS

Aggregation = Callable[..., tuple[Tensor, Tensor]]
get_loss_aggregation = LOSS_AGGREGATIONS.get


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(per_token: Tensor, mask: Tensor, *, norm_length: int | None = None):
    m = mask.to(per_token.dtype)
    return (per_token * m).sum(), m.sum()


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(per_token: Tensor, mask: Tensor, *, norm_length: int | None = None):
    m = mask.to(per_token.dtype)
    tokens = m.sum(dim=-1)
    per_seq = (per_token * m).sum(dim=-1) / tokens.clamp(min=1.0)
    return per_seq.sum(), (tokens > 0).to(per_token.dtype).sum()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(per_token: Tensor, mask: Tensor, *, norm_length: int | None = None):
    if norm_length is None:
        raise ValueError("seq-mean-token-sum-norm needs norm_length (algo.loss_norm_length)")
    m = mask.to(per_token.dtype)
    tokens = m.sum(dim=-1)
    return (per_token * m).sum() / norm_length, (tokens > 0).to(per_token.dtype).sum()
