"""Log-prob of the target and entropy from vocabulary-parallel logits, in chunks.

With z = logits / T over the full vocabulary (T the sampling temperature), p = softmax(z):

    logp_t  = z_t - m - log S,          m = max_j z_j,  S = sum_j exp(z_j - m)
    H       = log S - sum_j exp(z_j - m) (z_j - m) / S
    dlogp_t / dz_j = 1[j = t] - p_j
    dH / dz_j      = -p_j (log p_j + H)

Shapes: `logits [..., V/tp]` is this rank's shard, whose index is the rank in `group`;
`target [...]` holds global token ids. Columns at global index >= `vocab_size` (vocabulary
padding) are excluded, i.e. treated as -inf.

Communication, forward only, over `group` (tensor parallel): one MAX all-reduce of the
per-token local maxima `[n]` and one SUM all-reduce of `[n, 3]` (sum exp, sum exp*(z - m),
target logit), whatever the chunk count. Backward is local: it recomputes the softmax of each
chunk from the saved log-normaliser instead of keeping it.

Memory: the shard is never copied in full (pass it in its stored layout, e.g. Megatron's
`[s, b, V/tp]` with `target [s, b]`: a non-contiguous view would be copied by the reshape);
each chunk of `chunk_size` tokens makes a few fp32 `[chunk, V/tp]` temporaries. Backward
allocates the gradient (1x the shard, in its dtype).
"""

import torch
from torch import Tensor

from cwgrpo_megatron.comm.collectives import Group, max_over, rank_in, sum_over

CPU_CHUNK_ELEMENTS = 1 << 22
"""16 MiB of fp32 per temporary on CPU: past the caches already, and small next to the logits."""
GPU_CHUNK_ELEMENTS = 1 << 26
"""256 MiB of fp32 per temporary on a GPU, where each chunk costs about ten kernel launches:
[8192 tokens, 152064 / 2] bf16 logits take 10 chunks instead of 149, for 0.5 GiB of
temporaries next to the 1.2 GiB shard (`analysis.planner` counts them)."""


def chunk_elements(device: torch.device) -> int:
    return GPU_CHUNK_ELEMENTS if device.type == "cuda" else CPU_CHUNK_ELEMENTS


def _chunk_rows(chunk_size: int | None, vocab_shard: int, device: torch.device) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 token, got {chunk_size}")
        return chunk_size
    return max(1, chunk_elements(device) // max(vocab_shard, 1))


def _shifted_into(buf: Tensor, chunk: Tensor, shift: Tensor, temperature: float) -> Tensor:
    """buf[:r] = (chunk - shift[:, None]) / T in fp32; `chunk` (the caller's logits) is read only.

    bf16 is converted by a plain copy, then shifted in place: much faster on CPU than a
    mixed-dtype subtraction.
    """
    z = buf[: chunk.shape[0]]
    if chunk.dtype == torch.float32:
        torch.sub(chunk, shift[:, None], out=z)
    else:
        z.copy_(chunk).sub_(shift[:, None])
    if temperature != 1.0:
        z.mul_(1.0 / temperature)
    return z


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, chunk_size, temperature, vocab_size):
        shard = logits.shape[-1]
        start = rank_in(group) * shard
        valid = shard if vocab_size is None else max(0, min(shard, vocab_size - start))
        flat = logits.reshape(-1, shard)
        tgt = target.reshape(-1).to(torch.long) - start
        in_shard = (tgt >= 0) & (tgt < valid)
        tgt_local = torch.where(in_shard, tgt, torch.zeros_like(tgt))
        n = flat.shape[0]
        rows = min(_chunk_rows(chunk_size, shard, logits.device), max(n, 1))

        # Per token, in units of z = logits / T: the local max m_l, and relative to it
        # S_l = sum e^(z - m_l), T_l = sum e^(z - m_l) (z - m_l) and z_target - m_l.
        local_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
        local_sums = torch.zeros(n, 3, dtype=torch.float32, device=logits.device)
        if valid > 0:
            z_buf = torch.empty(rows, valid, dtype=torch.float32, device=logits.device)
            e_buf = torch.empty_like(z_buf)
            for i in range(0, n, rows):
                chunk = flat[i : i + rows, :valid]
                raw_max = chunk.amax(dim=-1).to(torch.float32)
                z = _shifted_into(z_buf, chunk, raw_max, temperature)
                e = torch.exp(z, out=e_buf[: z.shape[0]])
                local_max[i : i + rows] = raw_max / temperature
                local_sums[i : i + rows, 0] = e.sum(dim=-1)
                local_sums[i : i + rows, 2] = z.gather(-1, tgt_local[i : i + rows, None])[:, 0]
                local_sums[i : i + rows, 1] = e.mul_(z).sum(dim=-1)

        global_max = max_over(local_max, group)
        # Rescale to the global max M with a = e^(m_l - M): sum e^(z-M) = a S_l,
        # sum e^(z-M)(z-M) = a (T_l + (m_l - M) S_l), z_t - M = (z_t - m_l) + (m_l - M).
        # A shard of padding only has S_l = 0 and m_l = -inf: it contributes 0.
        has_mass = local_sums[:, 0] > 0
        shift = torch.where(has_mass, local_max - global_max, 0.0)
        scale = torch.exp(shift) * has_mass
        rescaled = torch.stack(
            [
                scale * local_sums[:, 0],
                scale * (local_sums[:, 1] + shift * local_sums[:, 0]),
                torch.where(in_shard, local_sums[:, 2] + shift, 0.0),
            ],
            dim=-1,
        )
        sum_exp, sum_ez, target_rel = sum_over(rescaled, group).unbind(-1)
        log_sum = torch.log(sum_exp)
        logp = target_rel - log_sum
        entropy = log_sum - sum_ez / sum_exp
        log_norm = global_max + log_sum  # log-sum-exp of z over the whole vocabulary

        ctx.save_for_backward(logits, tgt_local, in_shard, log_norm, entropy)
        ctx.config = (rows, temperature, valid)
        return logp.view(target.shape), entropy.view(target.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, tgt_local, in_shard, log_norm, entropy = ctx.saved_tensors
        rows, temperature, valid = ctx.config
        shard = logits.shape[-1]
        flat = logits.reshape(-1, shard)
        inv_t = 1.0 / temperature
        g_lp = grad_logp.reshape(-1).to(torch.float32) * inv_t
        g_h = grad_entropy.reshape(-1).to(torch.float32) * inv_t
        # dL/dlogits_j = (1/T) [g_lp (1[j=t] - p_j) - g_h p_j (log p_j + H)]
        #             = p_j (alpha + beta log p_j) + (g_lp / T) 1[j=t]
        alpha = -(g_lp + g_h * entropy)
        beta = -g_h
        target_grad = torch.where(in_shard, g_lp, 0.0)
        grad = torch.zeros(flat.shape, dtype=logits.dtype, device=logits.device)
        if valid > 0:
            lp_buf = torch.empty(rows, valid, dtype=torch.float32, device=logits.device)
            p_buf = torch.empty_like(lp_buf)
        for i in range(0, flat.shape[0] if valid > 0 else 0, rows):
            sl = slice(i, i + rows)
            logp_all = _shifted_into(
                lp_buf, flat[sl, :valid], log_norm[sl] * temperature, temperature
            )
            p = torch.exp(logp_all, out=p_buf[: logp_all.shape[0]])
            logp_all.mul_(beta[sl, None]).add_(alpha[sl, None])
            out = grad[sl, :valid]
            # fp32 writes straight into the gradient; bf16 is rounded once, at the end
            g = torch.mul(p, logp_all, out=out) if out.dtype == torch.float32 else p.mul_(logp_all)
            g.scatter_add_(-1, tgt_local[sl, None], target_grad[sl, None])
            if g is not out:
                out.copy_(g)
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_logprob_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    group: Group = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(logp, entropy), each `[...]` float32 and differentiable w.r.t. `logits`.

    logits: `[..., V/tp]` this rank's vocabulary shard (fp32 or bf16; never modified).
    target: `[...]` global token ids, each < vocab_size.
    group: the tensor-parallel group whose ranks hold the shards, in rank order; None = the
        whole vocabulary is here.
    chunk_size: tokens per chunk (default: about 4M logits per chunk).
    temperature: the sampling temperature T; log-probs are those of softmax(logits / T).
    vocab_size: the real vocabulary size; columns beyond it (padding) are masked out.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _LogprobEntropy.apply(logits, target, group, chunk_size, temperature, vocab_size)
