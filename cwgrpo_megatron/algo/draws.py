"""Counter-based uniform draws: one value per token, a pure function of (key, token position).

A stream from a seeded `torch.Generator` depends on how many values each rank draws, so the
tokens a rank picks would change with the layout. Hashing each token's global position
(`Scope.token_order`) with a shared key gives every token the same draw at every layout, with
no communication.

The hash is a 31-bit integer mixer (xor-shift-multiply, twice) applied to the position's low
and high 31-bit halves in turn, so every product stays below 2**58 and no int64 overflows:

    h = mix(mix(key) ^ hi) ,  h = mix(h ^ lo) ,  u = h / 2**31   in [0, 1)
"""

import torch
from torch import Tensor

_MASK31 = (1 << 31) - 1
_MULTIPLIER = 0x45D9F3B  # < 2**27: a 31-bit value times it fits in int64


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK31
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _MASK31
    return (x >> 16) ^ x


def token_uniform(order: Tensor, key: Tensor) -> Tensor:
    """u `[b, s]` float64 in [0, 1) from integer-valued positions `order [b, s]` (below 2**53,
    e.g. `Scope.token_order`) and a 0-dim int64 `key`."""
    position = order.to(torch.int64)
    h = _mix(_mix(key.to(position.device) & _MASK31) ^ (position >> 31))
    h = _mix(h ^ (position & _MASK31))
    return h.to(torch.float64) / float(1 << 31)
