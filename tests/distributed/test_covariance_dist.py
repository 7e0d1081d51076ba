"""Covariance weights and the CW-GRPO loss over gloo DP groups equal the 1-process result."""

import warnings

import pytest
import torch
import torch.distributed as dist

from cwgrpo_megatron.algo import PolicyBatch, build_policy_loss, get_policy_loss
from cwgrpo_megatron.comm import (
    LayoutDependentWarning,
    global_scope,
    micro_batch_scope,
    sum_over,
)
from cwgrpo_megatron.config import AlgoConfig
from tests.distributed.harness import run_distributed
from tests.pooled import covariance_weights
from tests.reference import ref_top_k_in_order

ROWS, COLS = 12, 10


def global_batch():
    """A fixed batch of 12 responses (3 prompts x 4), identical on every rank."""
    gen = torch.Generator().manual_seed(1234)
    old = -3.0 * torch.rand(ROWS, COLS, generator=gen, dtype=torch.float64)
    logp = old + 0.2 * torch.randn(ROWS, COLS, generator=gen, dtype=torch.float64)
    lengths = torch.randint(2, COLS + 1, (ROWS,), generator=gen)
    mask = (torch.arange(COLS)[None] < lengths[:, None]).double()
    adv = 1.5 * torch.randn(ROWS, 1, generator=gen, dtype=torch.float64) * mask
    return logp, old, adv, mask


def split_rows(rank, world):
    """Uneven contiguous row blocks; on 4 ranks, rank 3 holds only padding rows."""
    bounds = {2: [0, 5, 12], 4: [0, 2, 7, 12, 12]}[world]
    return slice(bounds[rank], bounds[rank + 1])


class CountingAllReduce:
    """Wraps torch.distributed.all_reduce to record the element count of each call."""

    def __init__(self):
        self.sizes = []
        self._orig = dist.all_reduce

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.sizes.append(tensor.numel())
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _weights_worker(rank, world):
    logp, old, adv, mask = global_batch()
    rows = split_rows(rank, world)
    local_mask = mask[rows].clone()
    if world == 4 and rank == 3:
        local_logp, local_adv = torch.zeros(2, COLS), torch.zeros(2, COLS)
        local_mask = torch.zeros(2, COLS)  # a rank that holds only padding
    else:
        local_logp, local_adv = old[rows], adv[rows]
    with CountingAllReduce() as counter:
        w = covariance_weights(local_logp, local_adv, local_mask, group=dist.group.WORLD)
    isolated = covariance_weights(local_logp, local_adv, local_mask, group=None)
    full = covariance_weights(old, adv, mask, group=None)
    expected = full[rows] if not (world == 4 and rank == 3) else torch.zeros(2, COLS)
    return {
        "err": (w - expected).abs().max().item() if w.numel() else 0.0,
        "control_err": (isolated - expected).abs().max().item() if w.numel() else 0.0,
        "finite": bool(torch.isfinite(w).all()),
        "allreduce_sizes": counter.sizes,
        "has_tokens": bool(local_mask.sum() > 0),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_covariance_weights_equal_concatenated_single_process(world):
    results = run_distributed(_weights_worker, world)
    for rank, r in enumerate(results):
        assert r["finite"], f"rank {rank} produced NaN/inf"
        assert r["err"] < 1e-6, f"rank {rank}: error {r['err']}"
        assert len(r["allreduce_sizes"]) <= 3, r["allreduce_sizes"]
        assert max(r["allreduce_sizes"]) <= 8, r["allreduce_sizes"]
    # Negative control: without the DP reduction the ranks that hold tokens disagree.
    assert max(r["control_err"] for r in results if r["has_tokens"]) > 1e-2


def _loss_worker(rank, world, scope_name, rank_rows, splits):
    """Global loss and per-token gradient of this rank's rows for one layout."""
    cfg = AlgoConfig(policy_loss="cw_grpo", kl_beta=0.0)
    logp, old, adv, mask = global_batch()
    lo, hi = rank_rows[rank]
    pad = max(0, hi - ROWS)  # rows past the batch are padding-only rows
    rows = slice(lo, min(hi, ROWS))

    def take(t):
        return torch.cat([t[rows], torch.zeros(pad, COLS, dtype=t.dtype)])

    l_logp, l_old, l_adv, l_mask = take(logp), take(old), take(adv), take(mask)
    bounds = splits[rank] + [l_mask.shape[0]]
    group = dist.group.WORLD if world > 1 else None
    loss = get_policy_loss("cw_grpo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if scope_name == "global":
            scope = global_scope(l_mask.shape[0], group=group)
        elif scope_name == "global-unreduced":  # negative control: the DP reduction removed
            scope = global_scope(l_mask.shape[0], group=None)
        else:
            mb_index = torch.zeros(l_mask.shape[0], dtype=torch.long)
            for i, start in enumerate(bounds[:-1]):
                mb_index[start:] = i
            scope = micro_batch_scope(mb_index)
    token_stat = loss.prepare(l_old, l_adv, l_mask, scope=scope, cfg=cfg).token_stat
    leaf = l_logp.clone().requires_grad_()
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        out = loss(
            PolicyBatch(
                logp=leaf[start:end],
                old_logp=l_old[start:end],
                advantages=l_adv[start:end],
                mask=l_mask[start:end],
                token_stat=token_stat[start:end],
            ),
            cfg,
        )
        total, count = total + out.loss_sum, count + out.num_tokens.double()
    global_count = sum_over(count.detach(), group)
    (total / global_count).backward()
    global_loss = sum_over(total.detach(), group) / global_count
    return {
        "loss": global_loss.item(),
        "grad_rows": leaf.grad[: hi - lo - pad].tolist(),
        "rows": (lo, min(hi, ROWS)),
        "warned": any(issubclass(w.category, LayoutDependentWarning) for w in caught),
    }


def _layout(world, rank_rows, splits, scope_name):
    if world == 1:
        return [_loss_worker(0, 1, scope_name, rank_rows, splits)]
    return run_distributed(_loss_worker, world, scope_name, rank_rows, splits)


def _assemble(results):
    grad = torch.zeros(ROWS, COLS, dtype=torch.float64)
    for r in results:
        lo, hi = r["rows"]
        if hi > lo:
            grad[lo:hi] = torch.tensor(r["grad_rows"], dtype=torch.float64)
    return results[0]["loss"], grad


LAYOUTS = {
    "1rank-x4mb": (1, [(0, 12)], [[0, 3, 6, 9]]),
    "2ranks-x-uneven-mb": (2, [(0, 7), (7, 19)], [[0, 2, 5], [0, 4]]),
    "4ranks-x1mb": (4, [(0, 3), (3, 6), (6, 9), (9, 12)], [[0], [0], [0], [0]]),
}


def test_global_scope_is_invariant_to_ranks_x_micro_batches():
    ref_loss, ref_grad = _assemble(_layout(*LAYOUTS["1rank-x4mb"], "global"))
    one_mb_loss, _ = _assemble(_layout(1, [(0, 12)], [[0]], "global"))
    assert abs(one_mb_loss - ref_loss) < 1e-12
    for name in ("2ranks-x-uneven-mb", "4ranks-x1mb"):
        results = _layout(*LAYOUTS[name], "global")
        loss, grad = _assemble(results)
        assert abs(loss - ref_loss) < 1e-10, f"{name}: loss {loss} vs {ref_loss}"
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12, msg=name)
        assert not any(r["warned"] for r in results)
    # Negative control: the same 2-rank layout without the DP reduction of the statistics.
    loss, grad = _assemble(_layout(*LAYOUTS["2ranks-x-uneven-mb"], "global-unreduced"))
    assert (grad - ref_grad).abs().max() > 1e-6


def test_micro_batch_scope_depends_on_layout_and_warns():
    ref_loss, ref_grad = _assemble(_layout(1, [(0, 12)], [[0]], "micro_batch"))
    results = _layout(*LAYOUTS["2ranks-x-uneven-mb"], "micro_batch")
    loss, grad = _assemble(results)
    assert all(r["warned"] for r in results)
    assert abs(loss - ref_loss) > 1e-6 or (grad - ref_grad).abs().max() > 1e-6


def tied_batch():
    """Few distinct values of l and A, so that many covariances tie at kl_cov's threshold."""
    gen = torch.Generator().manual_seed(99)
    logp = torch.randint(0, 3, (ROWS, COLS), generator=gen).double() * -0.5
    lengths = torch.randint(2, COLS + 1, (ROWS,), generator=gen)
    mask = (torch.arange(COLS)[None] < lengths[:, None]).double()
    adv = torch.tensor([1.0, -1.0, 0.0]).repeat(ROWS // 3).unsqueeze(-1).double() * mask
    return logp, adv, mask


def _kl_cov_worker(rank, world, bounds):
    logp, adv, mask = tied_batch()
    rows = slice(bounds[rank], bounds[rank + 1])
    local = mask[rows]
    group = dist.group.WORLD if world > 1 else None
    scope = global_scope(
        local.shape[0], group=group, row_order=torch.arange(bounds[rank], bounds[rank + 1])
    )
    cfg = AlgoConfig(policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.1}})
    prepared = build_policy_loss(cfg).prepare(logp[rows], adv[rows], local, scope=scope, cfg=cfg)
    return {"rows": (bounds[rank], bounds[rank + 1]), "selected": prepared.token_stat.tolist()}


@pytest.mark.parametrize("bounds", [[0, 5, 12], [0, 2, 7, 12, 12]], ids=["2ranks", "4ranks"])
def test_kl_cov_selects_exactly_k_with_ties_at_every_layout(bounds):
    """The global top-k of kl_cov, ties broken in global token order, is the same set of
    tokens on 1, 2 and 4 ranks (uneven rows; on 4 ranks one rank holds no rows)."""
    logp, adv, mask = tied_batch()
    results = run_distributed(_kl_cov_worker, len(bounds) - 1, bounds)
    selected = torch.zeros(ROWS, COLS, dtype=torch.float64)
    for r in results:
        lo, hi = r["rows"]
        if hi > lo:
            selected[lo:hi] = torch.tensor(r["selected"], dtype=torch.float64)
    single = _kl_cov_worker(0, 1, [0, ROWS])
    assert torch.equal(selected, torch.tensor(single["selected"], dtype=torch.float64))
    k = int(0.1 * mask.sum())
    assert int(selected.sum()) == k
    sel = mask > 0
    lv, av = logp[sel], adv[sel]
    cov = torch.zeros_like(mask)
    cov[sel] = (lv - lv.mean()) * (av - av.mean())
    values = cov[sel].sort(descending=True).values
    assert values[k - 1] == values[k], "the batch must tie at the threshold"
    assert torch.equal(selected > 0, ref_top_k_in_order(cov, mask, k))
