"""Vocab-parallel log-prob and entropy over gloo TP groups equal a full log_softmax."""

import pytest
import torch
import torch.distributed as dist

from cwgrpo_megatron.comm import vocab_parallel_logprob_entropy
from tests.distributed.harness import run_distributed

# (name, vocab_size, padded vocab, dtype): the padded vocab splits evenly over tp; the real
# vocab need not, so the last shards hold padding columns (and, at tp 4 with vocab 700, a
# whole shard of padding).
CASES = [
    ("even", 96, 96, torch.float32),
    ("padded", 1001, 1008, torch.float32),
    ("padding-shard", 700, 1008, torch.float32),
    ("bf16", 1001, 1008, torch.bfloat16),
]


def _case_errors(rank, world, vocab, padded, dtype, group):
    gen = torch.Generator().manual_seed(vocab)
    full = (3 * torch.randn(2, 5, padded, generator=gen)).to(dtype)
    full[..., vocab:] = 50.0  # garbage in the padding that must be masked
    target = torch.randint(0, vocab, (2, 5), generator=gen)
    g1, g2 = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    shard = padded // world
    mine = full[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
    logp, entropy = vocab_parallel_logprob_entropy(
        mine, target, group=group, chunk_size=3, temperature=0.8, vocab_size=vocab
    )
    (logp * g1 + entropy * g2).sum().backward()

    ref_in = full.double().requires_grad_()
    ref_all = torch.log_softmax(ref_in[..., :vocab] / 0.8, dim=-1)
    ref_logp = ref_all.gather(-1, target[..., None]).squeeze(-1)
    ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
    (ref_logp * g1 + ref_entropy * g2).sum().backward()
    ref_grad = ref_in.grad[..., rank * shard : (rank + 1) * shard]
    grad_scale = 2**-8 if dtype == torch.bfloat16 else 0.0
    grad_err = ((mine.grad.double() - ref_grad).abs() - grad_scale * ref_grad.abs()).clamp(min=0)
    return {
        "logp": (logp.double() - ref_logp).abs().max().item(),
        "entropy": (entropy.double() - ref_entropy).abs().max().item(),
        "grad": grad_err.max().item(),
    }


def _worker(rank, world):
    out = {}
    for name, vocab, padded, dtype in CASES:
        out[name] = _case_errors(rank, world, vocab, padded, dtype, dist.group.WORLD)
        # Negative control: the same shard without the TP reduction must not match.
        out[name + "/no-reduction"] = _case_errors(rank, world, vocab, padded, dtype, None)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_matches_full_softmax(tp):
    results = run_distributed(_worker, tp)
    for rank, errors in enumerate(results):
        for name, *_ in CASES:
            for what, err in errors[name].items():
                assert err < 2e-5, f"tp={tp} rank={rank} case={name} {what} error {err}"
            control = errors[name + "/no-reduction"]
            assert max(control["logp"], control["entropy"]) > 1e-2, (
                f"case {name}: removing the reduction went unnoticed"
            )
