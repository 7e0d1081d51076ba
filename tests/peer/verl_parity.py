"""Our baselines against verl's `core_algos.py` on identical tensors: the parity table.

Each row runs one quantity through both implementations and records max |ours - verl| and
that difference relative to the scale of verl's values (max |verl|), which stays meaningful
where values cross zero. Tolerances are a few ulps of accumulated rounding in the row's dtype
(`TOL`), except where a named design difference sets the gap (`DIFFERENCES`).

    python -m tests.peer.verl_parity          # prints the table (fetches the wheel once)

What is compared, in float64 and float32, on padded masks with equal-reward groups:
- GRPO / Dr.GRPO advantages;
- the clipped surrogate (grpo), its dual-clip and log-ratio clamp, in the three aggregations
  with global normalisers over 1-4 micro-batches: value and gradient w.r.t. the log-probs;
- the clip fractions (pg_clipfrac, pg_clipfrac_lower);
- the k1, k2, k3 estimators, with k3's clamps active and inactive;
- kl_cov (value, gradient) and clip_cov (gradient) per micro-batch, the `micro_batch` scope
  being verl's; kl_cov's selection count when every covariance ties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cwgrpo_megatron.algo import PolicyBatch, get_policy_loss
from cwgrpo_megatron.algo.advantages import broadcast_to_tokens, group_advantages
from cwgrpo_megatron.algo.kl import kl_term
from cwgrpo_megatron.algo.metrics import finalize
from cwgrpo_megatron.algo.scope import pools_from_index, single_pool
from cwgrpo_megatron.config import AlgoConfig
from tests.peer.verl_core import actor_config, fetch_wheel, load_core_algos

DTYPES = (torch.float64, torch.float32)
# a few ulps of the row's dtype, grown over sums of ~400 tokens
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
NORM_LENGTH = 24
P, G, S = 4, 4, NORM_LENGTH
# our advantages are float32: a relative rounding of 2**-24, grown by the mean and std
ADV_TOL = 2e-7
# verl's metric means divide by N + 1e-8: a relative change of at most 1e-8
GUARD_TOL = 1.1e-8
# verl's "no dual-clip": its vanilla loss always applies one, so a bound that never binds
NO_DUAL_CLIP = 1e30

DIFFERENCES = {
    "seq-mean-token-mean": "verl divides each sequence by n_i + 1e-8, we by n_i",
    "metric guard": "verl's masked means divide by N + 1e-8, ours by N",
    "float32 advantages": "our advantages are computed in float64 and stored in float32 (the "
    "TrainBatch's dtype) whatever the rewards' dtype; verl keeps the rewards' dtype",
    "group of 1": "verl gives A = r / (1 + eps); we give 0 (no group, no baseline) and warn",
    "clip_cov value": "verl multiplies a picked token's loss by 0, we detach its gradient and "
    "keep its value, so the reported loss stays the surrogate's",
    "kl_cov ties": "both take exactly k tokens; verl's torch.topk picks the tied ones in an "
    "unspecified order, we take them in global token order, the same at every layout",
    "k3 float32": "we evaluate expm1(x) - x, verl exp(x) - x - 1, which cancels near x = 0",
    "clip_cov picking": "verl permutes and takes exactly k band tokens, we draw each with "
    "p = k / n_band (k in expectation) so that it composes across ranks; equal when every band "
    "token is picked, as compared here",
    "scope": "verl pools Clip-Cov / KL-Cov statistics per micro-batch (our `micro_batch` scope, "
    "compared here); our default `global` scope pools the whole DP mini-batch",
    "clamps": "verl clamps log rho only in its vanilla loss and the value only for k3; we "
    "clamp log rho in every loss and every estimator's value (algo.log_ratio_clamp, kl_clamp)",
    "dual-clip default": "verl applies dual-clip with c = 3 by default; ours is off unless "
    "algo.clip_ratio_c is set",
}


@dataclass
class Row:
    quantity: str
    dtype: str
    max_abs: float
    scaled: float
    tol: float
    """Largest allowed `scaled`; inf marks a named design difference, reported, not judged."""
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.scaled <= self.tol

    @property
    def verdict(self) -> str:
        if math.isinf(self.tol):
            return "differs by design"
        return "ok" if self.ok else "FAIL"


def _compare(quantity, ours, theirs, dtype, tol=None, note="") -> Row:
    ours = torch.as_tensor(ours, dtype=torch.float64).detach()
    theirs = torch.as_tensor(theirs, dtype=torch.float64).detach()
    diff = float((ours - theirs).abs().max())
    scale = float(theirs.abs().max())
    scaled = diff / scale if scale > 0 else diff
    return Row(quantity, str(dtype).removeprefix("torch."), diff, scaled, tol or TOL[dtype], note)


# ---- the batch ------------------------------------------------------------------------------


def rewards(seed: int, dtype) -> Tensor:
    """[P, G] rewards in {0, 0.5, 1}; prompt 1's group is all equal."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (P, G), generator=gen).to(dtype) / 2
    r[1] = 1.0
    return r


def batch(seed: int, dtype, *, spread: float = 0.4):
    """logp, old, ref, adv, mask `[P G, S]`: padded rows (one empty), log ratios of both signs
    with some beyond the clips, advantages from `rewards`."""
    gen = torch.Generator().manual_seed(seed)
    b = P * G
    old = -4.0 * torch.rand(b, S, generator=gen, dtype=torch.float64)
    logp = old + spread * torch.randn(b, S, generator=gen, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(b, S, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, S + 1, (b,), generator=gen)
    lengths[5] = 0
    mask = (torch.arange(S)[None] < lengths[:, None]).double()
    adv = broadcast_to_tokens(group_advantages(rewards(seed, torch.float64)).reshape(-1), mask)
    return tuple(t.to(dtype) for t in (logp, old, ref, adv.double(), mask))


def splits(rows: int, parts: int) -> list[slice]:
    edges = np.linspace(0, rows, parts + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


# ---- both sides -----------------------------------------------------------------------------


def ours(name, cfg, logp, old, adv, mask, parts, *, ref=None, per_micro_batch=False):
    """(value, grad w.r.t. logp, finalized metrics) of our loss over `parts` micro-batches."""
    loss = get_policy_loss(name, **cfg.options.get(name, {}))
    cuts = splits(mask.shape[0], parts)
    if per_micro_batch:
        index = torch.zeros(mask.shape[0], dtype=torch.long)
        for i, cut in enumerate(cuts):
            index[cut] = i
        scope = pools_from_index(index, name="micro_batch")
    else:
        scope = single_pool(mask.shape[0])
    prepared = loss.prepare(
        logp, adv, mask, scope=scope, cfg=cfg, old_logp=old, generator=torch.Generator()
    )
    leaf = logp.clone().requires_grad_()
    total = count = 0
    metrics = {}
    for cut in cuts:
        stat = None if prepared.token_stat is None else prepared.token_stat[cut]
        out = loss(
            PolicyBatch(
                logp=leaf[cut],
                old_logp=old[cut],
                advantages=adv[cut],
                mask=mask[cut],
                token_stat=stat,
                ref_logp=None if ref is None else ref[cut],
            ),
            cfg,
        )
        total, count = total + out.loss_sum, count + out.num_tokens
        metrics = out.metrics
    value = total / count
    value.backward()
    return value.detach(), leaf.grad, finalize(metrics)


def theirs(core, name, acfg, logp, old, adv, mask, parts, agg="token-mean"):
    """(value, grad, metrics of the last micro-batch) of verl's loss with its global batch
    normalisers (dp_size 1), summed over `parts` micro-batches as its Megatron actor does."""
    acfg.global_batch_info = dict(
        dp_size=1,
        batch_num_tokens=mask.sum(),
        global_batch_size=(mask.sum(-1) > 0).sum(),
        loss_scale_factor=NORM_LENGTH,
    )
    fn = core.get_policy_loss_fn(name)
    leaf = logp.clone().requires_grad_()
    total, metrics = 0, {}
    for cut in splits(mask.shape[0], parts):
        value, metrics = fn(
            old_log_prob=old[cut],
            log_prob=leaf[cut],
            advantages=adv[cut],
            response_mask=mask[cut],
            loss_agg_mode=agg,
            config=acfg,
        )
        total = total + value
    total.backward()
    return total.detach(), leaf.grad, metrics


# ---- the rows -------------------------------------------------------------------------------


def advantage_rows(core, dtype) -> list[Row]:
    rows = []
    r = rewards(3, dtype)
    mask = torch.ones(P * G, S, dtype=dtype)
    mask[:, 10:] = 0
    index = np.repeat(np.arange(P), G)
    token_rewards = torch.zeros(P * G, S, dtype=dtype)
    token_rewards[:, 9] = r.reshape(-1)  # the score sits on the last response token
    for std_normalize, label in ((True, "GRPO"), (False, "Dr.GRPO")):
        verl_adv, _ = core.compute_grpo_outcome_advantage(
            token_rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=std_normalize
        )
        mine = broadcast_to_tokens(
            group_advantages(r, std_normalize=std_normalize).reshape(-1), mask
        )
        rows.append(
            _compare(
                f"advantages {label}, one group all equal",
                mine,
                verl_adv,
                dtype,
                tol=max(TOL[dtype], ADV_TOL),
                note=DIFFERENCES["float32 advantages"] if dtype == torch.float64 else "",
            )
        )
    single = torch.zeros(P, S, dtype=dtype)
    single[:, 9] = r[:, 0]
    verl_adv, _ = core.compute_grpo_outcome_advantage(single, mask[:P], np.arange(P))
    mine = broadcast_to_tokens(group_advantages(r[:, :1]).reshape(-1), mask[:P])
    row = _compare("advantages, group of 1", mine, verl_adv, dtype, tol=math.inf)
    row.note = DIFFERENCES["group of 1"]
    rows.append(row)
    return rows


def surrogate_rows(core, dtype) -> list[Row]:
    rows = []
    logp, old, ref, adv, mask = batch(4, dtype, spread=0.9)
    for agg in AGGS:
        norm = NORM_LENGTH if agg == "seq-mean-token-sum-norm" else None
        cfg = AlgoConfig(policy_loss="grpo", loss_agg=agg, loss_norm_length=norm)
        tol = TOL[dtype]
        note = ""
        if agg == "seq-mean-token-mean":
            # a sequence of n_i >= 1 tokens is scaled by n_i / (n_i + 1e-8) >= 1 - 1e-8
            tol, note = max(tol, GUARD_TOL), DIFFERENCES["seq-mean-token-mean"]
        for parts in (1, 2, 3, 4):
            acfg = actor_config(clip_ratio_c=NO_DUAL_CLIP)
            v, g, _ = ours("grpo", cfg, logp, old, adv, mask, parts)
            tv, tg, _ = theirs(core, "vanilla", acfg, logp, old, adv, mask, parts, agg)
            rows.append(_compare(f"grpo {agg}, {parts} mb: loss", v, tv, dtype, tol, note))
            rows.append(_compare(f"grpo {agg}, {parts} mb: grad", g, tg, dtype, tol, note))
    dual = AlgoConfig(policy_loss="grpo", clip_ratio_c=3.0)
    v, g, m = ours("grpo", dual, logp, old, adv, mask, 2)
    tv, tg, tm = theirs(core, "vanilla", actor_config(clip_ratio_c=3.0), logp, old, adv, mask, 2)
    rows.append(_compare("grpo + dual-clip c=3: loss", v, tv, dtype))
    rows.append(_compare("grpo + dual-clip c=3: grad", g, tg, dtype))
    # metrics of one micro-batch (verl returns those of the call)
    v, g, m = ours("grpo", dual, logp, old, adv, mask, 1)
    tv, tg, tm = theirs(core, "vanilla", actor_config(clip_ratio_c=3.0), logp, old, adv, mask, 1)
    tol, note = max(GUARD_TOL, TOL[dtype]), DIFFERENCES["metric guard"]
    clip = m["actor/clip_frac_low"] + m["actor/clip_frac_high"]
    rows.append(
        _compare(
            "pg_clipfrac = clip_frac_low + high", clip, tm["actor/pg_clipfrac"], dtype, tol, note
        )
    )
    rows.append(
        _compare(
            "pg_clipfrac_lower = clip_frac_dual",
            m["actor/clip_frac_dual"],
            tm["actor/pg_clipfrac_lower"],
            dtype,
            tol,
            note,
        )
    )
    # log rho beyond +-20 on a few tokens: both clamp it before exp
    far = logp.clone()
    far[0, :3] = old[0, :3] + 30.0
    far[2, :2] = old[2, :2] - 30.0
    v, g, _ = ours("grpo", dual, far, old, adv, mask, 1)
    tv, tg, _ = theirs(core, "vanilla", actor_config(clip_ratio_c=3.0), far, old, adv, mask, 1)
    rows.append(_compare("grpo, |log rho| > 20 (clamped): loss", v, tv, dtype))
    rows.append(_compare("grpo, |log rho| > 20 (clamped): grad", g, tg, dtype))
    return rows


def kl_rows(core, dtype) -> list[Row]:
    rows = []
    gen = torch.Generator().manual_seed(5)
    logp = (-4 * torch.rand(256, generator=gen, dtype=torch.float64)).to(dtype)
    near = (logp.double() + 0.5 * torch.randn(256, generator=gen, dtype=torch.float64)).to(dtype)
    far = logp.clone()
    far[:8] = logp[:8] + torch.tensor(
        [-40.0, -25.0, -15.0, -12.0, 12.0, 15.0, 25.0, 40.0], dtype=dtype
    )
    for name, verl_name in (("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")):
        for label, ref in (("near", near), ("clamps active", far)):
            if label == "clamps active" and name != "k3":
                continue  # verl bounds only k3; our kl_clamp on k1 / k2 is a named difference
            leaf = logp.clone().requires_grad_()
            mine = kl_term(leaf, ref, estimator=name, log_ratio_clamp=20.0, kl_clamp=10.0)
            mine.sum().backward()
            verl_leaf = logp.clone().requires_grad_()
            verl_kl = core.kl_penalty(verl_leaf, ref, verl_name)
            verl_kl.sum().backward()
            note = DIFFERENCES["k3 float32"] if (name, dtype) == ("k3", torch.float32) else ""
            rows.append(_compare(f"{name} ({label}): value", mine, verl_kl, dtype, note=note))
            rows.append(_compare(f"{name} ({label}): grad", leaf.grad, verl_leaf.grad, dtype))
    return rows


def cov_rows(core, dtype) -> list[Row]:
    rows = []
    logp, old, _, adv, mask = batch(6, dtype, spread=0.5)
    logp, adv = logp * 2.0, adv * 2.0  # covariances of order 1-10, inside Cui et al.'s band
    # 3 micro-batches, not 4: a micro-batch that is exactly the all-equal group would tie
    for parts in (1, 2, 3):
        cfg = AlgoConfig(
            policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.02}}, cov_scope="micro_batch"
        )
        acfg = actor_config(kl_cov_ratio=0.02)
        v, g, _ = ours("kl_cov", cfg, logp, old, adv, mask, parts, per_micro_batch=True)
        tv, tg, _ = theirs(core, "kl_cov", acfg, logp, old, adv, mask, parts)
        rows.append(_compare(f"kl_cov, {parts} mb: loss", v, tv, dtype))
        rows.append(_compare(f"kl_cov, {parts} mb: grad", g, tg, dtype))
        # clip_cov with every band token picked (ratio 1); off-policy, so PPO clips some
        cfg = AlgoConfig(
            policy_loss="clip_cov", options={"clip_cov": {"ratio": 1.0}}, cov_scope="micro_batch"
        )
        acfg = actor_config(clip_cov_ratio=1.0)
        v, g, m = ours("clip_cov", cfg, logp, old, adv, mask, parts, per_micro_batch=True)
        tv, tg, tm = theirs(core, "clip_cov", acfg, logp, old, adv, mask, parts)
        rows.append(_compare(f"clip_cov, {parts} mb: grad", g, tg, dtype))
        if parts == 1:
            row = _compare("clip_cov: loss", v, tv, dtype, tol=math.inf)
            row.note = DIFFERENCES["clip_cov value"]
            rows.append(row)
            rows.append(
                _compare(
                    "clip_cov: picked share (pg_clipfrac)",
                    m["actor/clip_cov_frac"],
                    tm["actor/pg_clipfrac"],
                    dtype,
                    max(GUARD_TOL, TOL[dtype]),
                    DIFFERENCES["metric guard"],
                )
            )
    # every covariance ties (A = 0): both must take exactly k = floor(ratio N) tokens
    tied = torch.zeros_like(adv)
    cfg = AlgoConfig(
        policy_loss="kl_cov", options={"kl_cov": {"ratio": 0.1}}, cov_scope="micro_batch"
    )
    _, g, _ = ours("kl_cov", cfg, logp, old, tied, mask, 1, per_micro_batch=True)
    _, tg, _ = theirs(core, "kl_cov", actor_config(kl_cov_ratio=0.1), logp, old, tied, mask, 1)
    # with A = 0 a token's gradient is the penalty's, non-zero exactly where it is selected
    k = max(1, int(0.1 * float(mask.sum())))
    note = DIFFERENCES["kl_cov ties"]
    rows.append(
        _compare(f"kl_cov, all tied: ours selects k = {k}", (g != 0).sum(), k, dtype, 0.0, note)
    )
    rows.append(_compare(f"kl_cov, all tied: verl selects k = {k}", (tg != 0).sum(), k, dtype, 0.0))
    return rows


def parity_rows(core=None) -> list[Row]:
    core = core or load_core_algos(fetch_wheel())
    rows = []
    for dtype in DTYPES:
        for build in (advantage_rows, surrogate_rows, kl_rows, cov_rows):
            rows.extend(build(core, dtype))
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| quantity | dtype | max abs diff | diff / max abs verl | tolerance | |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        tol = "-" if math.isinf(r.tol) else f"{r.tol:.1e}"
        lines.append(
            f"| {r.quantity} | {r.dtype} | {r.max_abs:.2e} | {r.scaled:.2e} | {tol} | {r.verdict} |"
        )
    notes = sorted(
        {r.note for r in rows if r.note}
        | {DIFFERENCES[k] for k in ("clip_cov picking", "scope", "clamps", "dual-clip default")}
    )
    lines.append("")
    lines.append("Design differences that remain:")
    lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines)


def main() -> None:
    rows = parity_rows()
    print(table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows)} rows, {len(failed)} outside tolerance")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
