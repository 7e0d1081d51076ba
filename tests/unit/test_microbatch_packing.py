"""Token-budget micro-batches: every row once, within the budget, padded to its own longest."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cwgrpo_megatron.data.batching import pack_rows, synthetic_batch


@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    budget=st.integers(64, 300),
)
def test_packing_covers_every_row_once_within_the_budget(lengths, budget):
    plan = pack_rows(torch.tensor(lengths), budget)
    rows = torch.cat([m.rows for m in plan]).tolist()
    assert sorted(rows) == list(range(len(lengths)))
    for m in plan:
        assert m.length == max(lengths[i] for i in m.rows.tolist())
        assert m.padded_tokens <= budget
    # greedy on the sorted rows: a micro-batch ends only where one more row would not fit
    for m, nxt in zip(plan, plan[1:], strict=False):
        assert (m.rows.numel() + 1) * m.length > budget
        assert nxt.length <= m.length
    # never more padding than fixed micro-batches of the same worst case
    fixed = len(lengths) * max(lengths)
    assert sum(m.padded_tokens for m in plan) <= fixed


def test_a_row_over_the_budget_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="a row of 70 tokens exceeds .*raise the budget"):
        pack_rows(torch.tensor([10, 70]), 64)


def test_gather_cuts_rows_to_the_micro_batch_length():
    batch = synthetic_batch(prompts=2, group_size=4, seq_len=32, vocab_size=100, seed=3)
    plan = batch.micro_batches(max_tokens=64)
    for m in plan:
        part = batch.gather(m)
        assert part.tokens.shape == (m.rows.numel(), m.length)
        # nothing of a row lies past its length: the cut drops padding only
        for i, row in enumerate(m.rows.tolist()):
            assert int(batch.lengths[row]) <= m.length
            assert batch.loss_mask[row, m.length :].sum() == 0
            assert torch.equal(part.tokens[i], batch.tokens[row, : m.length])
    assert batch.micro_batches(size=4)[1].rows.tolist() == [4, 5, 6, 7]


def test_sequence_parallel_padding_rounds_lengths_and_pads_with_masked_zeros():
    plan = pack_rows(torch.tensor([5, 9, 3, 7]), 24, multiple=4)
    assert [m.length for m in plan] == [12, 8]  # 9 -> 12 (rows 9, 7), then 5 -> 8 (5, 3)
    assert sorted(int(r) for m in plan for r in m.rows) == [0, 1, 2, 3]
    assert all(m.rows.numel() * m.length <= 24 for m in plan)
    batch = synthetic_batch(prompts=2, group_size=2, seq_len=10, vocab_size=50, seed=1)
    width = batch.tokens.shape[1]
    padded = batch.padded_to(4)
    assert padded.tokens.shape[1] == -(-width // 4) * 4 > width
    for name in ("tokens", "labels", "loss_mask", "advantages"):
        full = getattr(padded, name)
        assert torch.equal(full[:, :width], getattr(batch, name)), name
        assert not full[:, width:].any(), name
    assert torch.equal(padded.lengths, batch.lengths)
    assert batch.padded_to(1) is batch


def test_at_least_cuts_the_largest_micro_batches_until_there_are_enough():
    lengths = torch.tensor([3, 9, 4, 8, 2, 5])
    assert len(pack_rows(lengths, 40)) == 2  # 4 rows of <= 9, then 2 of <= 4
    plan = pack_rows(lengths, 40, at_least=4, multiple=2)
    # [1 3 5 2 | 0 4] -> [1 3 | 5 2 | 0 4] -> [1 | 3 | 5 2 | 0 4]
    assert [m.rows.tolist() for m in plan] == [[1], [3], [5, 2], [0, 4]]
    assert [m.length for m in plan] == [10, 8, 6, 4]  # each half to its own longest, rounded
    assert all(int(lengths[m.rows].max()) <= m.length for m in plan)
    with pytest.raises(ValueError, match="6 rows cannot make 7 micro-batches"):
        pack_rows(lengths, 40, at_least=7)
