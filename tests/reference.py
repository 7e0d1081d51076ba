"""Float64 reference implementations written straight from DESIGN section 1, for the tests.

Deliberately naive (boolean indexing, no pooling machinery, no shifts) so that they share no
code with the implementation under test.
"""

from fractions import Fraction

import torch
from torch import Tensor


def centred_exactly(x: Tensor) -> Tensor:
    """x - mean(x) in rational arithmetic, rounded once to float64; a value within the rule of
    `algo.covariance` (|x - x_bar| <= 2 N eps |x_bar|, float64's eps) counts as 0."""
    values = [Fraction(v) for v in x.tolist()]
    mean = sum(values) / len(values)
    floor = 2 * len(values) * Fraction(torch.finfo(torch.float64).eps) * abs(mean)
    return torch.tensor(
        [0.0 if abs(v - mean) <= floor else float(v - mean) for v in values], dtype=torch.float64
    )


def ref_weights(logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """w~ over all tokens with mask 1 (one pool); zeros elsewhere."""
    sel = mask > 0
    out = torch.zeros(mask.shape, dtype=torch.float64)
    if sel.sum() == 0:
        return out
    c = centred_exactly(logp.double()[sel]) * centred_exactly(adv.double()[sel])
    sigma = c.std(correction=0)
    w = torch.ones_like(c) if sigma == 0 else torch.exp(-(c**2) / (2 * sigma**2))
    out[sel] = w * c.numel() / w.sum()
    return out


def ref_weights_pooled(logp: Tensor, adv: Tensor, mask: Tensor, pool: Tensor) -> Tensor:
    """w~ with one independent pool per distinct value of `pool [b]`."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for p in pool.unique():
        rows = pool == p
        out[rows] = ref_weights(logp[rows], adv[rows], mask[rows])
    return out


def ref_group_advantages(rewards: Tensor, std_normalize: bool, eps: float) -> Tensor:
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for i, group in enumerate(rewards.double()):
        centred = group - group.mean()
        if std_normalize:
            std = group.std() if group.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + eps)
        out[i] = centred
    return out


def ref_surrogate_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv_hat: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> Tensor:
    """The global loss L (a scalar) of DESIGN section 1 with the k3 KL estimator."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(
        ratio * adv_hat, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv_hat
    )
    per_token = -surrogate
    if beta > 0:
        log_r = ref_logp - logp
        per_token = per_token + beta * (torch.exp(log_r) - 1 - log_r)
    m = mask.double()
    if agg == "token-mean":
        return (per_token * m).sum() / m.sum()
    seq_tokens = m.sum(-1)
    keep = seq_tokens > 0
    if agg == "seq-mean-token-mean":
        per_seq = (per_token * m).sum(-1)[keep] / seq_tokens[keep]
    else:
        per_seq = (per_token * m).sum(-1)[keep] / norm_length
    return per_seq.mean()


def ref_dual_clip_loss(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, eps: float, c: float
) -> Tensor:
    """Token-mean dual-clip PPO loss (Ye et al. 2020), written token by token."""
    total = torch.zeros((), dtype=torch.float64)
    for i, j in (mask > 0).nonzero().tolist():
        rho = torch.exp(logp[i, j] - old_logp[i, j])
        a = adv[i, j]
        x = -torch.minimum(rho * a, torch.clamp(rho, 1 - eps, 1 + eps) * a)
        if a < 0:
            x = torch.minimum(x, -c * a)
        total = total + x
    return total / mask.sum()


def ref_top_k_in_order(cov: Tensor, mask: Tensor, k: int) -> Tensor:
    """The k counted tokens of largest c, ties taken in row-major order (a stable sort)."""
    flat_c, flat_m = cov.reshape(-1), mask.reshape(-1) > 0
    candidates = [(-float(flat_c[i]), i) for i in range(flat_c.numel()) if flat_m[i]]
    chosen = torch.zeros(flat_c.numel(), dtype=torch.bool)
    for _, i in sorted(candidates)[:k]:
        chosen[i] = True
    return chosen.reshape(cov.shape)
