"""The only door to collectives: explicit process groups, `group=None` = this process alone."""

from cwgrpo_megatron.comm.collectives import (
    CollectiveTimeout,
    all_gather,
    all_gather_objects,
    broadcast_from,
    broadcast_into,
    broadcast_object,
    close_control_group,
    exchange,
    global_rank,
    job_rank,
    max_over,
    node_of_each_rank,
    open_control_group,
    rank_in,
    size_of,
    sum_over,
    world_group,
)
from cwgrpo_megatron.comm.failures import (
    PeerFailure,
    agree_on_failure,
    all_gather_or_fail,
    fail_together,
)
from cwgrpo_megatron.comm.metrics import reduce_metrics
from cwgrpo_megatron.comm.scopes import (
    LayoutDependentWarning,
    global_scope,
    group_scope,
    make_scope,
    micro_batch_scope,
)
from cwgrpo_megatron.comm.vocab_parallel import vocab_parallel_logprob_entropy

__all__ = [
    "CollectiveTimeout",
    "LayoutDependentWarning",
    "PeerFailure",
    "agree_on_failure",
    "all_gather",
    "all_gather_objects",
    "all_gather_or_fail",
    "broadcast_from",
    "broadcast_into",
    "broadcast_object",
    "close_control_group",
    "exchange",
    "fail_together",
    "global_rank",
    "global_scope",
    "job_rank",
    "group_scope",
    "make_scope",
    "max_over",
    "micro_batch_scope",
    "node_of_each_rank",
    "open_control_group",
    "rank_in",
    "reduce_metrics",
    "size_of",
    "sum_over",
    "vocab_parallel_logprob_entropy",
    "world_group",
]
