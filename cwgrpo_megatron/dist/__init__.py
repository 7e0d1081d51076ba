"""The only door to collectives: explicit process groups, `group=None` = this process alone."""

from cwgrpo_megatron.dist.collectives import (
    all_gather,
    broadcast_from,
    broadcast_into,
    gather_objects,
    global_rank,
    max_over,
    rank_in,
    scatter_objects,
    size_of,
    sum_over,
)
from cwgrpo_megatron.dist.covariance import covariance_weights
from cwgrpo_megatron.dist.metrics import reduce_metrics
from cwgrpo_megatron.dist.scopes import (
    LayoutDependentWarning,
    global_scope,
    group_scope,
    make_scope,
    micro_batch_scope,
)
from cwgrpo_megatron.dist.vocab_parallel import vocab_parallel_logprob_entropy

__all__ = [
    "LayoutDependentWarning",
    "all_gather",
    "broadcast_from",
    "broadcast_into",
    "covariance_weights",
    "gather_objects",
    "global_rank",
    "global_scope",
    "group_scope",
    "make_scope",
    "max_over",
    "micro_batch_scope",
    "rank_in",
    "reduce_metrics",
    "scatter_objects",
    "size_of",
    "sum_over",
    "vocab_parallel_logprob_entropy",
]
