"""The training batch: token rows with per-token loss mask, advantage and rollout log-probs.

Row i holds one response with its prompt, right-padded to a common length s. Position t
predicts `labels[i, t] = tokens[i, t + 1]`; every per-token field lives on those label
positions, so `loss_mask[i, t] = 1` exactly when `labels[i, t]` is a response token.

Splitting keeps prompt groups whole: a mini-batch and a data-parallel shard are unions of
whole groups, so the `group` scope never needs communication and a prompt group never spans
data-parallel ranks. The global mini-batch k is the same set of rows whatever the layout:
the rollout batch is first cut into mini-batches, then each mini-batch into DP shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cwgrpo_megatron.algo.advantages import broadcast_to_tokens, group_advantages


@dataclass(kw_only=True)
class TrainBatch:
    tokens: Tensor
    """[b, s] int64 prompt + response ids, right-padded."""
    labels: Tensor
    """[b, s] int64 next-token targets (tokens shifted left by one)."""
    loss_mask: Tensor
    """[b, s] float32, 1 where labels is a response token."""
    advantages: Tensor
    """[b, s] float32 per-token advantage A_i (zero outside the mask)."""
    rollout_logp: Tensor | None
    """[b, s] float32 sampling log-probs of the labels (zero outside the mask); None when the
    rows were not sampled by a rollout engine (synthetic batches)."""
    prompt_index: Tensor
    """[b] int64 global prompt id of each row."""
    lengths: Tensor
    """[b] int64 prompt + response tokens of each row; the rest of the row is padding."""

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def position_ids(self) -> Tensor:
        b, s = self.tokens.shape
        return torch.arange(s, device=self.tokens.device).unsqueeze(0).expand(b, s)

    def _map(self, fn) -> TrainBatch:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TrainBatch(**{k: None if v is None else fn(v) for k, v in values.items()})

    def to(self, device: torch.device | str) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    def select(self, rows: slice) -> TrainBatch:
        return self._map(lambda t: t[rows])

    def split(self, parts: int) -> list[TrainBatch]:
        """`parts` equal consecutive slices; each must hold whole prompt groups."""
        if self.rows % parts:
            raise ValueError(f"{self.rows} rows do not split into {parts} equal parts")
        size = self.rows // parts
        self._check_whole_groups(size)
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(parts)]

    def micro_batches(
        self,
        *,
        size: int | None = None,
        max_tokens: int | None = None,
        multiple: int = 1,
        at_least: int = 1,
    ) -> list[MicroBatch]:
        """How this shard is cut for the forward and backward passes: consecutive blocks of
        `size` rows at the full length s, or, with `max_tokens`, `pack_rows` of the lengths
        (at least `at_least` of them), each padded to a multiple of `multiple` tokens
        (`padded_to` the shard first)."""
        if max_tokens is not None:
            return pack_rows(self.lengths, max_tokens, multiple=multiple, at_least=at_least)
        if size is None or self.rows % size:
            raise ValueError(f"{self.rows} rows are not a multiple of micro_batch_size={size}")
        s = self.tokens.shape[1]
        rows = torch.arange(self.rows, device=self.tokens.device)
        return [MicroBatch(rows=r, length=s) for r in rows.split(size)]

    def padded_to(self, multiple: int) -> TrainBatch:
        """Per-token fields right-padded with zeros to a multiple of `multiple` tokens (padding
        is masked out, and causal attention keeps it from earlier positions)."""
        extra = -self.tokens.shape[1] % multiple
        if not extra:
            return self
        return self._map(lambda t: F.pad(t, (0, extra)) if t.dim() == 2 else t)

    def gather(self, micro: MicroBatch) -> TrainBatch:
        """The rows of `micro`, cut to its length: `[m, length]` per-token fields."""
        return self._map(lambda t: t[micro.rows, : micro.length] if t.dim() == 2 else t[micro.rows])

    def shard(self, rank: int, size: int) -> TrainBatch:
        """This data-parallel rank's block of whole prompt groups."""
        return self.split(size)[rank]

    def _check_whole_groups(self, size: int) -> None:
        idx = self.prompt_index
        for start in range(size, self.rows, size):
            if idx[start] == idx[start - 1]:
                raise ValueError(
                    f"a cut at row {start} would split prompt {int(idx[start])} across parts; "
                    "cut at prompt-group boundaries"
                )


@dataclass(frozen=True)
class MicroBatch:
    rows: Tensor
    """[m] int64 positions of its rows in the shard."""
    length: int
    """Tokens per row after padding: the longest of its rows (s for fixed-size ones)."""

    @property
    def padded_tokens(self) -> int:
        return self.rows.numel() * self.length


def pack_rows(
    lengths: Tensor, max_tokens: int, *, multiple: int = 1, at_least: int = 1
) -> list[MicroBatch]:
    """Greedy token-budget packing: rows sorted by length, longest first (ties by position),
    each micro-batch takes the next rows while rows x its first (longest) length stays within
    `max_tokens`. Every statistic and normaliser of the step is global, so how rows are packed
    changes no number, only the padding: a micro-batch is padded to its own longest row,
    rounded up to a multiple of `multiple` (sequence parallelism).

    `at_least`: the micro-batch with the most rows (the first of those) is cut in two, longer
    half first, until there are that many (ranks whose every forward joins one collective, as
    expert parallelism's all-to-all, must run as many)."""
    if lengths.numel() == 0:
        return []
    longest = int(lengths.max())
    if longest > max_tokens:
        raise ValueError(
            f"a row of {longest} tokens exceeds train.max_tokens_per_micro_batch={max_tokens}; "
            "raise the budget to at least data.max_prompt_tokens + rollout.max_tokens"
        )
    order = torch.sort(lengths, descending=True, stable=True).indices
    sizes = lengths[order].tolist()
    out, start = [], 0
    while start < len(sizes):
        length = -(-sizes[start] // multiple) * multiple
        end = min(len(sizes), start + max(1, max_tokens // length))
        out.append(MicroBatch(rows=order[start:end], length=length))
        start = end
    if at_least > lengths.numel():
        raise ValueError(
            f"{lengths.numel()} rows cannot make {at_least} micro-batches, as ranks that share an "
            "expert-parallel all-to-all need; give each data-parallel rank at least as many rows"
        )
    while len(out) < at_least:
        i = max(range(len(out)), key=lambda j: (out[j].rows.numel(), -j))
        rows, half = out[i].rows, (out[i].rows.numel() + 1) // 2
        rest = -(-int(lengths[rows[half:]].max()) // multiple) * multiple
        out[i : i + 1] = [
            MicroBatch(rows=rows[:half], length=out[i].length),
            MicroBatch(rows=rows[half:], length=rest),
        ]
    return out


def build_train_batch(
    *,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[Sequence[int]]],
    rewards: Tensor,
    rollout_logps: Sequence[Sequence[Sequence[float]]] | None = None,
    loss_rows: Tensor | None = None,
    pad_id: int = 0,
    estimator=group_advantages,
    std_normalize: bool = True,
    adv_eps: float = 1e-6,
    seq_len: int | None = None,
) -> TrainBatch:
    """Rows for P prompts x G responses, GRPO advantages from `rewards [P, G]`.

    `responses[p][g]` are the sampled ids of response g of prompt p, `rollout_logps[p][g]` their
    sampling log-probs (optional; the batch's `rollout_logp` is None without them). Rows are
    padded to `seq_len` (default: the longest prompt + response). `estimator` is a registered
    advantage estimator (`algo.advantages`), given `std_normalize` and `adv_eps`.
    `loss_rows [P, G]` (bool) False gives a response no loss (overlong masking); its reward
    still enters its group's advantage baseline.
    """
    num_prompts, group = rewards.shape
    if len(prompts) != num_prompts or any(len(r) != group for r in responses):
        raise ValueError("prompts / responses do not match rewards [prompts, group_size]")
    adv_rows = estimator(rewards, std_normalize=std_normalize, eps=adv_eps).reshape(-1)
    longest = max(len(p) + len(r) for p, rs in zip(prompts, responses, strict=True) for r in rs)
    s = seq_len or longest
    if s < longest:
        raise ValueError(f"seq_len={s} is shorter than the longest prompt + response ({longest})")
    rows = num_prompts * group
    tokens = torch.full((rows, s + 1), pad_id, dtype=torch.long)
    lengths = torch.zeros(rows, dtype=torch.long)
    mask = torch.zeros(rows, s)
    logp = torch.zeros(rows, s)
    prompt_index = torch.arange(num_prompts).repeat_interleave(group)
    for p, prompt in enumerate(prompts):
        for g, response in enumerate(responses[p]):
            i = p * group + g
            if not response:
                raise ValueError(f"response {g} of prompt {p} is empty")
            n_p, n_r = len(prompt), len(response)
            tokens[i, :n_p] = torch.tensor(prompt)
            tokens[i, n_p : n_p + n_r] = torch.tensor(response)
            lengths[i] = n_p + n_r
            # position t predicts token t + 1: response tokens are labels n_p - 1 ... n_p + n_r - 2
            mask[i, n_p - 1 : n_p + n_r - 1] = 1.0
            if rollout_logps is not None:
                if len(rollout_logps[p][g]) != n_r:
                    raise ValueError(
                        f"response {g} of prompt {p} has {n_r} tokens but "
                        f"{len(rollout_logps[p][g])} rollout log-probs"
                    )
                logp[i, n_p - 1 : n_p + n_r - 1] = torch.tensor(rollout_logps[p][g])
    if loss_rows is not None:
        mask = mask * loss_rows.reshape(rows, 1).to(mask.dtype)
    return TrainBatch(
        tokens=tokens[:, :s].contiguous(),
        labels=tokens[:, 1 : s + 1].contiguous(),
        loss_mask=mask,
        advantages=broadcast_to_tokens(adv_rows, mask),
        rollout_logp=logp if rollout_logps is not None else None,
        prompt_index=prompt_index,
        lengths=lengths,
    )


def synthetic_batch(
    *, prompts: int, group_size: int, seq_len: int, vocab_size: int, seed: int = 0
) -> TrainBatch:
    """A fixed, seeded batch of random prompts, responses and 0/1 rewards (layout-free)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, vocab_size, (n,), generator=gen).tolist()

    prompt_ids = [
        ids(int(torch.randint(2, seq_len // 2, (1,), generator=gen))) for _ in range(prompts)
    ]
    responses = [
        [
            ids(int(torch.randint(1, seq_len - len(p) + 1, (1,), generator=gen)))
            for _ in range(group_size)
        ]
        for p in prompt_ids
    ]
    rewards = torch.randint(0, 2, (prompts, group_size), generator=gen).float()
    return build_train_batch(
        prompts=prompt_ids, responses=responses, rewards=rewards, seq_len=seq_len
    )


def batch_from_rollouts(
    groups, rewards: Tensor, *, mask_truncated: bool = False, **options
) -> TrainBatch:
    """The TrainBatch of rollout groups (`rollout.RolloutGroup`, G completions each) and their
    rewards `[P, G]`; with `mask_truncated`, completions that finished by length get no loss;
    `options` go to `build_train_batch` (pad_id, seq_len, ...)."""
    loss_rows = None
    if mask_truncated:
        loss_rows = torch.tensor(
            [[c.finish_reason != "length" for c in g.completions] for g in groups]
        )
    return build_train_batch(
        prompts=[g.prompt_ids for g in groups],
        responses=[[c.token_ids for c in g.completions] for g in groups],
        rewards=rewards,
        rollout_logps=[[c.logprobs for c in g.completions] for g in groups],
        loss_rows=loss_rows,
        **options,
    )
