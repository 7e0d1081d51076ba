"""Which experts a MoE model's router picks, recorded from the forward passes, and how often two
recordings of the same tokens disagree.

Routing is discrete: a rounding that moves a token's k-th and (k+1)-th expert scores past each
other sends it to another expert, and its log-prob then moves by far more than the rounding.
`topk_differ` counts how often that happens between two forwards of the same tokens (two
layouts, two dtypes, the trainer and another implementation).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router import TopKRouter


@contextmanager
def recorded_routing(model) -> Iterator[list[torch.Tensor]]:
    """Inside the block, each forward of each of `model`'s routers appends its tokens' top-k
    expert ids, [tokens, k] int64 sorted within a row, to the yielded list, in call order (a
    forward pass appends one entry per layer of this stage, in layer order). Tokens are the
    router's [s / tp, b] flattened s-major, as the router sees them. No communication."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    calls: list[torch.Tensor] = []

    def keep(module, args, output):
        _, routing_map = output  # [tokens, E] bool, k True per row
        ids = routing_map.float().topk(module.topk, dim=-1).indices
        calls.append(ids.sort(dim=-1).values.detach().cpu())

    handles = [r.register_forward_hook(keep) for r in routers]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def topk_differ(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The fraction of (router call, token) pairs whose top-k expert sets differ between two
    recordings (`recorded_routing`) of the same forwards over the same tokens:

        sum_calls #{tokens t: set(a[t]) != set(b[t])} / sum_calls #tokens

    ValueError when the recordings are not of the same calls (counts or shapes differ)."""
    if len(a) != len(b) or not a:
        raise ValueError(
            f"{len(a)} router calls against {len(b)}: the recordings are not of the same "
            "forward passes"
        )
    differ = total = 0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            raise ValueError(
                f"router call of shape {tuple(x.shape)} against {tuple(y.shape)}: not the "
                "same tokens"
            )
        differ += int((x != y).any(dim=-1).sum())
        total += x.shape[0]
    return differ / total
