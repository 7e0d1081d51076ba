"""A seeded channel permutation of a Qwen2 / Llama checkpoint: the same function, other fp32
reduction orders.

Permutations that leave the network's output unchanged in exact arithmetic, per layer l:

    G_l   of the KV groups (each group's q heads move with it)         [n_kv]
    V_lg  of the head_dim coordinates of group g's values             [head_dim] per group
    P_l   of the MLP's intermediate channels                          [ffn]

applied as   q, k rows by G;  v rows by (G, V);  o_proj columns by (G, V) per q head;
             gate, up rows by P;  down columns by P;

and one of the vocabulary, T [V]: the rows of the embedding and of the output layer, and every
token id of the batch (`tokens`).

q and k keep their head_dim order: RoPE pairs coordinate i with i + head_dim / 2 at frequency
i, so permuting them would change the function. The permuted model contracts o_proj and
down_proj (forward) and q/k/v/gate/up (backward, input gradient) in another order; these are
the contractions that tensor parallelism splits into partial sums, and the softmax and the
output layer's input gradient sum over the vocabulary in another order, as vocab-parallel
cross-entropy does. `tools/check_layout.py --calibrate` uses it to measure fp32 noise with
nothing else changed. The hidden size is not permuted: no layout splits its sums.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from cwgrpo_megatron.convert.arch import ModelArch

_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")


class ChannelPermutation:
    """`apply(name, hf_tensor)` into the permuted model, `invert` back (other names unchanged);
    `tokens(ids)` maps the inputs."""

    def __init__(self, arch: ModelArch, seed: int) -> None:
        self.arch = arch
        self.seed = seed
        self._index: dict[int, dict[str, Tensor]] = {}
        gen = torch.Generator().manual_seed(seed * 100_003 + 99_991)
        self._vocab = torch.randperm(arch.vocab_size, generator=gen)
        self._new_id = torch.argsort(self._vocab)

    def tokens(self, ids: Tensor) -> Tensor:
        """Token ids of the original model as ids of the permuted one (same shape)."""
        return self._new_id.to(ids.device)[ids]

    def _layer(self, layer: int) -> dict[str, Tensor]:
        if layer not in self._index:
            a = self.arch
            gen = torch.Generator().manual_seed(self.seed * 100_003 + layer)
            groups = torch.randperm(a.num_kv_heads, generator=gen)
            v_dims = [torch.randperm(a.head_dim, generator=gen) for _ in range(a.num_kv_heads)]
            dims = torch.arange(a.head_dim)
            r = a.heads_per_group
            q_heads = torch.cat([g * r + torch.arange(r) for g in groups.tolist()])
            self._index[layer] = {
                "q": torch.cat([h * a.head_dim + dims for h in q_heads.tolist()]),
                "k": torch.cat([g * a.head_dim + dims for g in groups.tolist()]),
                "v": torch.cat([g * a.head_dim + v_dims[g] for g in groups.tolist()]),
                "o": torch.cat([h * a.head_dim + v_dims[h // r] for h in q_heads.tolist()]),
                "ffn": torch.randperm(a.ffn_hidden_size, generator=gen),
            }
        return self._index[layer]

    def _where(self, name: str) -> tuple[int, Tensor] | None:
        """(dim, index) with permuted[.., j, ..] = original[.., index[j], ..], or None."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self._vocab
        m = _NAME.match(name)
        if m is None:
            return None
        index = self._layer(int(m.group(1)))
        proj, kind = m.group(3), m.group(4)
        if proj in ("q", "k", "v"):
            return 0, index[proj]
        if proj in ("gate", "up"):
            return 0, index["ffn"]
        if kind == "weight" and proj == "o":
            return 1, index["o"]
        if kind == "weight" and proj == "down":
            return 1, index["ffn"]
        return None

    def apply(self, name: str, tensor: Tensor) -> Tensor:
        where = self._where(name)
        return tensor if where is None else tensor.index_select(where[0], where[1])

    def invert(self, name: str, tensor: Tensor) -> Tensor:
        where = self._where(name)
        if where is None:
            return tensor
        return torch.empty_like(tensor).index_copy_(where[0], where[1], tensor)
