"""Vocabulary-parallel log-prob and entropy in one process (group=None) equal a full
log_softmax: fp32 at several chunk sizes, temperature and padding masks, bf16 input, bad input.
The TP 2 and 4 versions are in tests/distributed/test_vocab_parallel_dist.py."""

import pytest
import torch

from cwgrpo_megatron.comm import vocab_parallel_logprob_entropy


def reference(logits, target, temperature=1.0, vocab_size=None):
    z = logits.double()
    if vocab_size is not None:
        z = z[..., :vocab_size]
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def check(logits, target, *, tol, grad_rtol=0.0, **kwargs):
    x = logits.clone().requires_grad_()
    before = logits.clone()
    logp, entropy = vocab_parallel_logprob_entropy(x, target, **kwargs)
    assert logp.dtype == torch.float32 and logp.shape == target.shape
    gen = torch.Generator().manual_seed(0)
    g1, g2 = torch.randn(target.shape, generator=gen), torch.randn(target.shape, generator=gen)
    (logp * g1 + entropy * g2).sum().backward()
    assert torch.equal(x.detach(), before), "logits must not be modified in place"
    assert x.grad.dtype == logits.dtype

    xr = logits.double().requires_grad_()
    kw = {k: v for k, v in kwargs.items() if k in ("temperature", "vocab_size")}
    ref_logp, ref_entropy = reference(xr, target, **kw)
    (ref_logp * g1 + ref_entropy * g2).sum().backward()
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=grad_rtol, atol=tol)
    return x.grad


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 64], ids=lambda c: f"chunk{c}")
def test_matches_log_softmax_fp32(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(3, 7, 50, generator=gen)
    target = torch.randint(0, 50, (3, 7), generator=gen)
    check(logits, target, tol=1e-5, chunk_size=chunk_size)


def test_temperature_and_padding_mask():
    gen = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(4, 6, 64, generator=gen)
    logits[..., 60:] = 100.0  # padded columns hold garbage that would dominate if not masked
    target = torch.randint(0, 60, (4, 6), generator=gen)
    grad = check(logits, target, tol=1e-5, temperature=0.7, vocab_size=60, chunk_size=5)
    assert torch.all(grad[..., 60:] == 0)


def test_bf16_input():
    gen = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(2, 9, 40, generator=gen)).to(torch.bfloat16)
    target = torch.randint(0, 40, (2, 9), generator=gen)
    # values are computed in fp32 from the bf16 logits; the gradient is rounded to bf16 (2^-8)
    check(logits, target, tol=1e-5, grad_rtol=2**-8, chunk_size=4)


def test_bad_input():
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprob_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprob_entropy(
            torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0
        )
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprob_entropy(
            torch.randn(2, 5), torch.zeros(2, dtype=torch.long), chunk_size=0
        )
