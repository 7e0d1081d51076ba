"""The covariance histogram and the top-1% share of sum |c| (`algo.metrics`), against exact
sorts; the TensorBoard form of the step's histogram (`step_metrics.cov_histogram`)."""

import math

import pytest
import torch

from cwgrpo_megatron.algo.metrics import (
    COV_BINS,
    cov_bin_edges,
    covariance_histogram,
    finalize,
    histograms,
    merge,
    top_share,
)
from cwgrpo_megatron.comm.metrics import reduce_metrics


def exact_top_share(c: torch.Tensor, fraction: float) -> float:
    """Sort |c|; the top fraction x N tokens, the last one pro rata."""
    mags = c.abs().double().flatten().sort(descending=True).values
    wanted = fraction * mags.numel()
    whole = int(wanted)
    share = mags[:whole].sum() + (wanted - whole) * (mags[whole] if whole < mags.numel() else 0)
    return float(share / mags.sum())


def share_of(c: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    mask = torch.ones_like(c) if mask is None else mask
    h = covariance_histogram(c, mask)
    return float(top_share(h["cw/cov_hist_count"].value, h["cw/cov_hist_abs"].value, 0.01))


def test_bins_count_every_counted_token_once_by_sign_and_magnitude():
    c = torch.tensor([[-3.0, -3e-5, 0.0, 2e-9, 5e-3, 7e5], [1.1, 1.1, -1.1, 9.0, 9.0, 9.0]])
    mask = torch.ones_like(c)
    mask[1, 3:] = 0  # the three 9s are padding
    h = covariance_histogram(c, mask)
    counts, sums = h["cw/cov_hist_count"].value, h["cw/cov_hist_abs"].value
    assert counts.shape == sums.shape == (COV_BINS,)
    assert counts.sum() == 9 and sums.sum() == pytest.approx(3 + 3e-5 + 2e-9 + 5e-3 + 7e5 + 3.3)
    edges = cov_bin_edges()
    for value in (-3.0, -3e-5, 5e-3, 1.1, -1.1):  # none on an edge
        i = int(torch.searchsorted(edges, torch.tensor(value, dtype=torch.float64), right=True))
        assert counts[i - 1] >= 1, value  # the bin [edges[i-1], edges[i]) holds it
    centre = COV_BINS // 2
    assert counts[centre] == 2  # 0 and 2e-9: |c| < 1e-8
    assert counts[-1] == 1 and sums[-1] == 7e5  # beyond 1e4: the last bin
    assert counts[centre + 1 :].sum() == 4 and counts[:centre].sum() == 3


def test_top_share_is_exact_when_the_top_percent_fills_whole_bins():
    # 100 of 10,000 tokens at |c| = 10, the rest at 0.01: the top 1% are exactly the 10s
    c = torch.full((100, 100), 0.01, dtype=torch.float64)
    c[:1] = 10.0
    c[50:, :] *= -1  # signs do not matter
    want = 1000.0 / (1000.0 + 9900 * 0.01)
    assert exact_top_share(c, 0.01) == pytest.approx(want, rel=1e-12)
    assert share_of(c) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_share_matches_a_sort_on_heavy_tailed_covariances(seed):
    gen = torch.Generator().manual_seed(seed)
    # log-prob deviations times advantages: a heavy tail, as in a real step
    c = torch.randn(64, 200, generator=gen) * torch.randn(64, 1, generator=gen).exp()
    c = c * torch.randn(64, 200, generator=gen).abs() ** 3
    exact = exact_top_share(c, 0.01)
    # the only approximation: the boundary bin's tokens (|c| within a factor 1.33) taken pro rata
    assert share_of(c) == pytest.approx(exact, abs=0.01 * exact)
    assert 0.05 < exact < 0.6


def test_uniform_covariance_gives_one_percent_and_all_zero_is_undefined():
    assert share_of(torch.full((10, 100), -0.25)) == pytest.approx(0.01, rel=1e-12)
    assert math.isnan(share_of(torch.zeros(4, 8)))


def test_histograms_merge_and_reduce_like_the_whole_batch():
    gen = torch.Generator().manual_seed(3)
    c = torch.randn(12, 30, generator=gen) ** 3
    mask = (torch.rand(12, 30, generator=gen) > 0.2).float()
    whole = covariance_histogram(c, mask)
    parts = merge(covariance_histogram(c[:5], mask[:5]), covariance_histogram(c[5:], mask[5:]))
    for name in ("cw/cov_hist_count", "cw/cov_hist_abs"):
        torch.testing.assert_close(parts[name].value, whole[name].value, rtol=1e-12, atol=0)
    reduced = reduce_metrics(parts)  # one process: the identity, but through the packing
    torch.testing.assert_close(
        histograms(reduced)["cw/cov_hist_count"], whole["cw/cov_hist_count"].value
    )
    final = finalize(reduced)
    assert "cw/cov_hist_count" not in final
    assert float(final["cw/top1pct_cov_share"]) == pytest.approx(share_of(c, mask), rel=1e-12)


def test_step_histogram_is_tensorboards_raw_form(tmp_path):
    from cwgrpo_megatron.megatron.train_step import StepResult
    from cwgrpo_megatron.run.step_metrics import cov_histogram

    c = torch.tensor([[-2.0, 0.5, 0.5, 3.0]])
    mask = torch.ones_like(c)
    h = covariance_histogram(c, mask)
    hists = {k: m.value.tolist() for k, m in h.items()}
    n, mean, sq = 4, float(c.mean()), float((c * c).mean())
    results = [
        StepResult(0.0, 1.0, False, {"cw/cov_mean": mean, "cw/cov_sq_mean": sq}, histograms=hists)
        for _ in range(2)
    ]
    got = cov_histogram(results)
    assert got.num == 2 * n and sum(got.bucket_counts) == 2 * n
    assert got.sum == pytest.approx(2 * float(c.sum())) and got.sum_squares == pytest.approx(
        2 * float((c * c).sum())
    )
    assert got.min <= -2.0 < got.min * 0.7 and got.max / 1.34 < 3.0 <= got.max
    assert len(got.bucket_limits) == len(got.bucket_counts) == COV_BINS
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    writer.add_histogram_raw("cw/cov", *got, global_step=1)
    writer.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    events.Reload()
    (event,) = events.Histograms("cw/cov")
    assert event.histogram_value.num == 2 * n
