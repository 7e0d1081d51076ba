"""CW-GRPO weights with the covariance statistics pooled over a process group, for the tests:
the train step pools them through its `Scope` (`comm.make_scope`); this is that path alone."""

from torch import Tensor

from cwgrpo_megatron.algo import covariance as algo_cov
from cwgrpo_megatron.comm import global_scope
from cwgrpo_megatron.comm.collectives import Group


def covariance_weights(logp: Tensor, adv: Tensor, mask: Tensor, *, group: Group = None) -> Tensor:
    """w~ `[b, s]` (float32, zero where mask == 0) over every counted token of every rank.

    logp, adv, mask: `[b, s]`; adv is already broadcast per token. The statistics of DESIGN
    section 1 (N, l_bar, A_bar, sigma, sum w) cover all tokens with mask 1 on all ranks of
    `group` (None: this process only).

    Communication: 3 all-reduces (SUM, float64) over `group`, of 3, 2 and 1 scalars. A rank
    with zero tokens takes part and gets an all-zero result.
    """
    scope = global_scope(mask.shape[0], group=group, device=mask.device)
    weights, _ = algo_cov.covariance_weights(logp, adv, mask, scope)
    return weights
