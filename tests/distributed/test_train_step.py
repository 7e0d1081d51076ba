"""The CW-GRPO train step gives the same numbers at every layout (gloo, 1-4 processes)."""

import contextlib
import dataclasses
import json
import re
import warnings
from functools import partial
from unittest import mock

import pytest
import torch

from tests.distributed.harness import run_distributed, run_tool

# (tp, pp, micro-batches per DP rank); world = 4 except the reference, so dp = 4 / (tp pp)
LAYOUTS = {
    "tp1-pp1-dp1-mb4": (1, 1, 4, 1),
    "tp2-dp2-mb1": (2, 1, 1, 4),
    "pp2-dp2-mb2": (1, 2, 2, 4),
    "tp2-pp2-mb4": (2, 2, 4, 4),
}


def _run(rank, world, tp, pp, micro_batches, overrides, batch_kind, mini_batches=1, forced=False):
    """layout_check.run, counting the step's forward-only passes; `forced`: the step runs its
    forward-only pass whatever the loss (as every step did before `needs_policy_pass`)."""
    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.comm.scopes import LayoutDependentWarning
    from cwgrpo_megatron.megatron import train_step

    batch_fn = None
    if batch_kind == "equal-rewards":
        batch_fn = _equal_rewards_batch
    elif batch_kind == "padding-rank":
        batch_fn = _padding_rank_batch
    elif batch_kind == "nan-advantage":
        batch_fn = _nan_advantage_batch
    elif batch_kind == "engine-logp":
        batch_fn = _engine_logp_batch
    passes = []
    real_forward_only = train_step.forward_only

    def counted(*args, **kwargs):
        passes.append(1)
        return real_forward_only(*args, **kwargs)

    # the pool's workers outlive the task: the patches are undone on leaving
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(train_step, "forward_only", counted))
        if forced:
            patches.enter_context(mock.patch.object(train_step, "needs_policy_pass", _always))
        caught = patches.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        result = layout_check.run(
            tp=tp,
            pp=pp,
            micro_batches=micro_batches,
            global_batch=16,
            group_size=4,
            seq_len=16,
            steps=2,
            overrides=overrides,
            batch_fn=batch_fn,
            mini_batches=mini_batches,
        )
    result["warned"] = any(issubclass(w.category, LayoutDependentWarning) for w in caught)
    result["forward_passes"] = len(passes)
    return result


def _always(cfg, mini_batches):
    return True


def _equal_rewards_batch(step, arch):
    from cwgrpo_megatron.data.batching import build_train_batch

    gen = torch.Generator().manual_seed(step)
    prompts = [torch.randint(1, 1000, (4,), generator=gen).tolist() for _ in range(4)]
    responses = [
        [torch.randint(1, 1000, (6,), generator=gen).tolist() for _ in range(4)] for _ in prompts
    ]
    return build_train_batch(
        prompts=prompts, responses=responses, rewards=torch.full((4, 4), 0.5), seq_len=16
    )


def _padding_rank_batch(step, arch):
    """The second half of the batch (rank 1 of dp 2) has no counted token at all."""
    from cwgrpo_megatron.data.batching import synthetic_batch

    batch = synthetic_batch(prompts=4, group_size=4, seq_len=16, vocab_size=1000, seed=step)
    batch.loss_mask[8:] = 0
    batch.advantages[8:] = 0
    return batch


def _nan_advantage_batch(step, arch):
    """Step 0 carries a NaN advantage (a broken reward), step 1 is clean."""
    from cwgrpo_megatron.data.batching import synthetic_batch

    batch = synthetic_batch(prompts=4, group_size=4, seq_len=16, vocab_size=1000, seed=step)
    if step == 0:
        row, col = torch.nonzero(batch.loss_mask)[0]
        batch.advantages[row, col] = float("nan")
    return batch


def _engine_logp_batch(step, arch):
    """The synthetic batch with sampling log-probs of its own (an engine's stand-in: not the
    trainer's, so statistics from them differ from the trainer's)."""
    from cwgrpo_megatron.data.batching import synthetic_batch

    batch = synthetic_batch(prompts=4, group_size=4, seq_len=16, vocab_size=1000, seed=step)
    gen = torch.Generator().manual_seed(100 + step)
    logp = -3 * torch.rand(batch.tokens.shape, generator=gen) * batch.loss_mask
    return dataclasses.replace(batch, rollout_logp=logp)


_RUNS: dict = {}


def layout(name, overrides=(), batch_kind=None, mini_batches=1, forced=False):
    """The run's result; the same arguments run once per session (the runs are seeded and
    deterministic), so tests that share a reference do not pay for it twice."""
    key = (name, tuple(overrides), batch_kind, mini_batches, forced)
    if key not in _RUNS:
        tp, pp, mb, world = LAYOUTS[name]
        if mini_batches > 1:
            mb = max(mb // mini_batches, 1)
        _RUNS[key] = run_distributed(
            _run, world, tp, pp, mb, list(overrides), batch_kind, mini_batches, forced
        )[0]
    return _RUNS[key]


def assert_same(a, b, rtol, what):
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor(a[key]),
            torch.tensor(b[key]),
            rtol=rtol,
            atol=1e-7,
            msg=f"{what}: {key} {a[key]} vs {b[key]}",
        )
    assert abs(a["param_checksum"] - b["param_checksum"]) <= rtol * abs(b["param_checksum"]), what


@pytest.mark.parametrize("loss", ["cw_grpo", "grpo"])
def test_layouts_agree_with_sgd(loss):
    overrides = [f"algo.policy_loss={loss}"]
    ref = layout("tp1-pp1-dp1-mb4", overrides)
    assert all(abs(x) > 1e-4 for x in ref["grad_norm"]), "the step must move the parameters"
    assert ref["param_checksum"] != ref["initial_checksum"]
    for name in ("tp2-dp2-mb1", "pp2-dp2-mb2", "tp2-pp2-mb4"):
        got = layout(name, overrides)
        assert got["layout"]["dp"] == 4 // (got["layout"]["tp"] * got["layout"]["pp"])
        assert_same(got, ref, 1e-5, f"{loss} {name}")
        # the covariance diagnostics, logged for every loss, are global too
        for a, b in zip(got["metrics"], ref["metrics"], strict=True):
            for key in ("cw/sigma", "cw/top1pct_cov_share"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), (name, key, a[key], b[key])
            assert 0.01 < b["cw/top1pct_cov_share"] < 1


def test_grpo_with_one_mini_batch_runs_no_forward_only_pass_and_the_same_step():
    """l_old from the training forward's own log-probs, and the diagnostics after it: no
    forward-only pass, and the losses, gradient norms, parameters and every metric of the step
    that runs the pass, at TP1, TP2 x DP2 and PP2 x DP2."""
    grpo = ["algo.policy_loss=grpo"]  # the runs of test_layouts_agree_with_sgd
    for name in ("tp1-pp1-dp1-mb4", "tp2-dp2-mb1", "pp2-dp2-mb2"):
        got, today = layout(name, grpo), layout(name, grpo, forced=True)
        assert got["forward_passes"] == 0 and today["forward_passes"] == 2, name  # 2 steps
        assert_same(got, today, 1e-6, f"no pass {name}")
        for a, b in zip(got["metrics"], today["metrics"], strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (name, key)
    assert layout("tp1-pp1-dp1-mb4", ["algo.policy_loss=cw_grpo"])["forward_passes"] == 2


def test_engine_statistics_run_no_forward_only_pass_at_every_layout():
    """algo.stats_logp=rollout: cw_grpo's statistics from the batch's sampling log-probs, with
    no forward-only pass; the same step at TP1, TP2 x DP2 and PP2 x DP2, and c, sigma and w~
    those of the sampling log-probs (computed here in one process), not the trainer's."""
    from cwgrpo_megatron.algo import get_policy_loss
    from cwgrpo_megatron.algo.config import AlgoConfig
    from cwgrpo_megatron.algo.metrics import finalize
    from cwgrpo_megatron.comm import make_scope

    cw = ["algo.policy_loss=cw_grpo"]
    engine = [*cw, "algo.stats_logp=rollout"]
    ref = layout("tp1-pp1-dp1-mb4", engine, batch_kind="engine-logp")
    trainer = layout("tp1-pp1-dp1-mb4", cw, batch_kind="engine-logp")
    assert ref["forward_passes"] == 0 and trainer["forward_passes"] == 2
    for step, metrics in enumerate(ref["metrics"]):
        batch = _engine_logp_batch(step, None)
        expected = finalize(
            get_policy_loss("cw_grpo")
            .prepare(
                batch.rollout_logp,
                batch.advantages,
                batch.loss_mask,
                scope=make_scope("global", batch_size=16),
                cfg=AlgoConfig(),
            )
            .metrics
        )
        for key in ("cw/sigma", "cw/cov_mean", "cw/w_max", "cw/frac_w_below_half"):
            assert metrics[key] == pytest.approx(float(expected[key]), rel=1e-5), (step, key)
            assert metrics[key] != pytest.approx(trainer["metrics"][step][key], rel=1e-3), key
        assert metrics["rollout/gap_mean"] > 0.1  # the trainer's gap to the stand-in
    for name in ("tp2-dp2-mb1", "pp2-dp2-mb2"):
        got = layout(name, engine, batch_kind="engine-logp")
        assert got["forward_passes"] == 0
        assert_same(got, ref, 1e-5, f"engine statistics {name}")


ADAM_PROBED = ["optim.optimizer=adam", "optim.lr=1e-3", "run.probe_groups=4"]


def test_layouts_agree_with_adam():
    # Adam divides by sqrt(v): parameters whose gradients are ~0 amplify fp32 reduction-order
    # noise into visible updates, so the check is looser than SGD's 1e-5.
    ref = layout("tp1-pp1-dp1-mb4", ADAM_PROBED)
    got = layout("tp2-pp2-mb4", ADAM_PROBED)
    assert_same(got, ref, 1e-3, "adam tp2-pp2-mb4")


def test_the_probe_entropy_is_the_policys_before_each_update_at_every_layout():
    """Step 1's probe is its whole batch (4 groups) before the update: the entropy its training
    forward logs. Step 2's is the same sequences under the updated policy."""
    ref = layout("tp1-pp1-dp1-mb4", ADAM_PROBED)
    first, second = ref["probe_entropy"]
    assert first == pytest.approx(ref["metrics"][0]["actor/entropy"], rel=1e-6)
    assert abs(second - first) > 1e-4, "the update must move the probe's entropy"
    for name in ("tp2-pp2-mb4", "pp2-dp2-mb2"):
        got = layout(name, ADAM_PROBED)["probe_entropy"]
        assert got == pytest.approx(ref["probe_entropy"], rel=1e-5), name


def test_micro_batch_scope_depends_on_layout_and_warns():
    overrides = ["algo.cov_scope=micro_batch"]
    ref = layout("tp1-pp1-dp1-mb4", overrides)
    got = layout("tp2-dp2-mb1", overrides)
    assert ref["warned"] and got["warned"]
    assert abs(got["param_checksum"] - ref["param_checksum"]) > 1e-5 * abs(ref["param_checksum"])


def test_equal_rewards_leave_parameters_unchanged():
    result = layout("tp2-dp2-mb1", batch_kind="equal-rewards")
    assert result["loss"] == [0.0, 0.0]
    assert result["grad_norm"] == [0.0, 0.0]
    assert result["param_checksum"] == result["initial_checksum"]


def test_rank_holding_only_padding():
    ref = layout("tp1-pp1-dp1-mb4", batch_kind="padding-rank")
    got = layout("pp2-dp2-mb2", batch_kind="padding-rank")
    assert all(torch.isfinite(torch.tensor(got["loss"] + got["grad_norm"])))
    assert_same(got, ref, 1e-5, "padding rank")


def _count_scope_reductions(rank, world):
    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.comm import scopes

    sizes = []
    original = scopes.sum_over

    def counted(t, group):
        sizes.append(t.numel())
        return original(t, group)

    scopes.sum_over = counted
    try:
        layout_check.run(
            tp=1, pp=2, micro_batches=2, global_batch=16, group_size=4, seq_len=16, steps=1
        )
    finally:
        scopes.sum_over = original
    return sizes


def test_scope_statistics_use_at_most_three_tiny_all_reduces():
    per_rank = run_distributed(_count_scope_reductions, 4)  # pp 2 x dp 2
    with_stats = [s for s in per_rank if s]
    assert len(with_stats) == 2, per_rank  # only the two last-stage ranks compute statistics
    for sizes in with_stats:
        assert len(sizes) == 3 and max(sizes) <= 8, sizes


def test_layouts_agree_with_kl_to_the_reference_policy():
    # step 0: policy == reference, so the KL term has no gradient; step 1 exercises it
    overrides = ["algo.kl_beta=0.5", "algo.kl_estimator=k3"]
    ref = layout("tp1-pp1-dp1-mb4", overrides)
    plain = layout("tp1-pp1-dp1-mb4", ["algo.policy_loss=cw_grpo"])  # the default loss
    assert ref["loss"][0] == pytest.approx(plain["loss"][0], rel=1e-6)
    assert ref["param_checksum"] != plain["param_checksum"], "the KL term must change the update"
    assert_same(layout("tp2-pp2-mb4", overrides), ref, 1e-5, "kl tp2-pp2")


def test_layouts_agree_with_two_ppo_mini_batches():
    ref = layout("tp1-pp1-dp1-mb4", mini_batches=2)
    assert len(ref["loss"]) == 4  # 2 rollout batches x 2 optimizer steps
    for name in ("tp2-dp2-mb1", "pp2-dp2-mb2"):
        assert_same(layout(name, mini_batches=2), ref, 1e-5, f"mini-batches {name}")


def test_non_finite_gradient_skips_the_step():
    result = layout("tp2-dp2-mb1", batch_kind="nan-advantage")
    assert result["skipped"] == [True, False]
    clean = layout("tp2-dp2-mb1", batch_kind="nan-advantage", overrides=["optim.lr=0.0"])
    assert clean["skipped"] == [True, False]
    # the skipped step left the parameters as they were: only step 1 moved them
    assert result["param_checksum"] != result["initial_checksum"]
    assert clean["param_checksum"] == clean["initial_checksum"]


def _lr_sequence(rank, world):
    import math

    from cwgrpo_megatron.checks import layout_check
    from cwgrpo_megatron.megatron import parallel

    cfg = layout_check.layout_config(
        tp=1,
        pp=1,
        micro_batches=1,
        global_batch=8,
        group_size=4,
        steps=10,
        world_size=1,
        overrides=[
            "optim.optimizer=adam",
            "optim.lr=1e-3",
            "optim.warmup_ratio=0.2",
            "optim.min_lr_ratio=0.1",
        ],
    )
    actor, _ = layout_check.tiny_actor(cfg)
    try:
        got = []
        for _ in range(10):
            actor.scheduler.step(increment=1)
            got.append(actor.optimizer.param_groups[0]["lr"])
    finally:
        parallel.destroy()
    peak, low, warm, total = 1e-3, 1e-4, 2, 10
    want = []
    for step in range(1, 11):
        if step <= warm:
            want.append(peak * step / warm)
        else:
            frac = (step - warm) / (total - warm)
            want.append(low + (peak - low) * 0.5 * (math.cos(math.pi * frac) + 1))
    return got, want


def test_lr_schedule_is_warmup_then_cosine_to_the_minimum():
    ((got, want),) = run_distributed(_lr_sequence, 1)
    assert got == pytest.approx(want, rel=1e-9)


def test_gradient_clipping_bounds_the_update():
    # SGD with lr 1: the parameter change is the (clipped) gradient, so clipping at a tenth of
    # the gradient norm must shrink the first update tenfold; grad_norm reports the norm before
    # clipping in both runs.
    free = layout("tp2-dp2-mb1", overrides=["optim.lr=1.0"])
    norm = free["grad_norm"][0]
    clipped = layout("tp2-dp2-mb1", overrides=["optim.lr=1.0", f"optim.clip_grad={norm / 10}"])
    assert clipped["grad_norm"][0] == pytest.approx(norm, rel=1e-6)
    moved_free = abs(free["param_checksum"] - free["initial_checksum"])
    moved_clipped = abs(clipped["param_checksum"] - clipped["initial_checksum"])
    assert moved_clipped < 0.5 * moved_free


def test_clip_cov_picks_the_same_tokens_at_every_layout():
    """Clip-Cov's draws hash each token's global position (the train step's row order), so it
    picks the same tokens at DP1 and TP2xDP2; two PPO mini-batches make the second one
    off-policy (the band then excludes tokens PPO clipped). kl_cov's tie-break by the same
    order is tested across ranks in test_covariance_dist.py."""
    loss, picked = "clip_cov", "actor/clip_cov_frac"
    overrides = [
        f"algo.policy_loss={loss}",
        "algo.options.clip_cov.ratio=0.05",
        "algo.options.clip_cov.lb=0.05",
    ]
    ref = layout("tp1-pp1-dp1-mb4", overrides, mini_batches=2)
    assert all(m[picked] > 0 for m in ref["metrics"]), [m[picked] for m in ref["metrics"]]
    grpo = layout("tp1-pp1-dp1-mb4", ["algo.policy_loss=grpo"], mini_batches=2)
    assert ref["param_checksum"] != grpo["param_checksum"], f"{loss} must change the update"
    got = layout("tp2-dp2-mb1", overrides, mini_batches=2)
    assert_same(got, ref, 1e-5, f"{loss} tp2-dp2")
    for a, b in zip(got["metrics"], ref["metrics"], strict=True):
        assert a[picked] == pytest.approx(b[picked], rel=1e-12)


def test_recompute_gives_the_same_step():
    """Activation recompute reruns the forward in backward: the same losses, gradients and
    parameters, at a layout with every kind of parallelism."""
    cw = ["algo.policy_loss=cw_grpo"]  # the reference run of test_layouts_agree_with_sgd
    ref = layout("tp2-pp2-mb4", cw)
    for granularity in ("full", "selective"):
        got = layout("tp2-pp2-mb4", [*cw, f"train.recompute_granularity={granularity}"])
        assert got["loss"] == ref["loss"], granularity
        assert_same(got, ref, 1e-6, f"recompute {granularity}")


# rows of at most 8 + 8 tokens, packed 40 tokens a micro-batch
BUDGET = [
    "train.max_tokens_per_micro_batch=40",
    "data.max_prompt_tokens=8",
    "rollout.max_tokens=8",
    "rollout.max_model_len=32",
]


def test_token_budget_micro_batches_give_the_same_step():
    """Packed micro-batches (sorted by length, each padded to its own longest row) change no
    statistic or normaliser: the same losses, gradient norms and parameters as fixed-size
    micro-batches, at TP1, TP2 x DP2 and PP2 x DP2, with fewer padded tokens."""
    cw = ["algo.policy_loss=cw_grpo"]  # the reference run of test_layouts_agree_with_sgd
    ref = layout("tp1-pp1-dp1-mb4", cw)
    for name in ("tp1-pp1-dp1-mb4", "tp2-dp2-mb1", "pp2-dp2-mb2"):
        got = layout(name, [*cw, *BUDGET])
        assert_same(got, ref, 1e-5, f"token budget {name}")
        assert all(g < r for g, r in zip(got["padded_tokens"], ref["padded_tokens"], strict=True))
    assert ref["padded_tokens"] == [16 * 16, 16 * 16]


def _padded_step(rank, world, multiple, budget):
    from cwgrpo_megatron.checks.layout_check import layout_config, tiny_actor
    from cwgrpo_megatron.data.batching import synthetic_batch
    from cwgrpo_megatron.megatron import parallel
    from cwgrpo_megatron.megatron.train_step import param_checksum, train_step

    overrides = ["algo.policy_loss=cw_grpo", *(BUDGET if budget else [])]
    cfg = layout_config(
        tp=2, pp=1, micro_batches=2, global_batch=16, group_size=4, steps=1, world_size=world,
        overrides=overrides,
    )  # fmt: skip
    actor, arch = tiny_actor(cfg)
    try:
        # what sequence parallelism asks for (tp on a GPU with TE), forced here on CPU
        actor.sequence_multiple = multiple
        batch = synthetic_batch(prompts=4, group_size=4, seq_len=13, vocab_size=arch.vocab_size)
        results = train_step(actor, batch)
        steps = [(r.loss, r.grad_norm, r.padded_tokens) for r in results]
        return steps, param_checksum(actor.model)
    finally:
        parallel.destroy()


@pytest.mark.parametrize("budget", [False, True], ids=["fixed-rows", "token-budget"])
def test_padding_micro_batches_for_sequence_parallelism_changes_nothing(budget):
    """Sequence parallelism needs micro-batches of a multiple of tp tokens. The padding is
    masked out: at TP2 a step padded to multiples of 4 gives the unpadded step's loss, gradient
    norm and parameters, with more padded tokens, fixed-size or packed."""
    (plain, plain_sum), _ = run_distributed(_padded_step, 2, 1, budget)
    (padded, padded_sum), _ = run_distributed(_padded_step, 2, 4, budget)
    for (loss, norm, tokens), (loss4, norm4, tokens4) in zip(plain, padded, strict=True):
        assert loss4 == pytest.approx(loss, rel=1e-6, abs=1e-9)
        assert norm4 == pytest.approx(norm, rel=1e-6)
        assert tokens4 > tokens and tokens4 % 4 == 0
    assert padded_sum == pytest.approx(plain_sum, rel=1e-6)


def _moe_run(rank, world, hf_dir, ep, tp=1, batch_fn=None, overrides=()):
    from cwgrpo_megatron.checks import layout_check

    return layout_check.run(
        tp=tp,
        micro_batches=2,
        global_batch=16,
        group_size=4,
        seq_len=16,
        steps=2,
        hf_dir=hf_dir,
        overrides=[f"parallel.ep={ep}", *overrides],
        batch_fn=batch_fn,
    )


def _uneven_batch(step, arch):
    """Data-parallel rank 0's rows (the first 8) are 5 tokens long, rank 1's 15: packed 16 to a
    micro-batch, rank 0 needs 3 and rank 1 8."""
    from cwgrpo_megatron.data.batching import build_train_batch

    gen = torch.Generator().manual_seed(step)
    prompts = [torch.randint(1, 1000, (3,), generator=gen).tolist() for _ in range(4)]
    responses = [
        [torch.randint(1, 1000, (2 if p < 2 else 12,), generator=gen).tolist() for _ in range(4)]
        for p in range(4)
    ]
    rewards = torch.rand((4, 4), generator=gen)
    return build_train_batch(prompts=prompts, responses=responses, rewards=rewards, seq_len=16)


def _router_only_batch(step, arch, *, counted, seq_len):
    """Equal rewards (no policy gradient: only the routers' loss moves the weights) with the
    first `counted` of each 6-token response in the loss, padded to `seq_len`."""
    from cwgrpo_megatron.data.batching import build_train_batch

    gen = torch.Generator().manual_seed(step)
    prompts = [torch.randint(1, 1000, (3 + p,), generator=gen).tolist() for p in range(4)]
    responses = [
        [torch.randint(1, 1000, (6,), generator=gen).tolist() for _ in range(4)] for _ in prompts
    ]
    batch = build_train_batch(
        prompts=prompts, responses=responses, rewards=torch.full((4, 4), 0.5), seq_len=seq_len
    )
    for row, first in enumerate(batch.loss_mask.float().argmax(1).tolist()):
        batch.loss_mask[row, first + counted :] = 0
    return batch


def _save_moe(folder, aux_loss_coef=None) -> str:
    from tests.distributed.qwen_fixtures import make_hf_model

    model = make_hf_model("qwen3-moe")
    if aux_loss_coef is not None:
        model.config.router_aux_loss_coef = aux_loss_coef
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _save_moe(tmp_path_factory.mktemp("qwen3-moe"))  # Qwen3-MoE's coefficient, 0.001


@pytest.fixture(scope="module")
def moe_reference(moe_dir):
    """The tiny Qwen3-MoE's steps on 2 data-parallel ranks with every expert on each."""
    return run_distributed(_moe_run, 2, moe_dir, 1)[0]


@pytest.mark.parametrize(
    ("world", "tp", "expert_tp"),
    [(2, 1, 1), (4, 2, 1), (4, 2, 2)],
    ids=["dp2-ep2", "tp2-dp2-ep2", "tp2-dp2-ep2-etp2"],
)
def test_moe_expert_parallel_step_agrees(moe_dir, moe_reference, world, tp, expert_tp):
    # the same CW-GRPO step with the experts split over 2 ranks (the all-to-all dispatch), and
    # beside TP2, where Megatron's MoE layer needs sequence parallelism (on CPU: the local
    # spec's `SequenceParallelRMSNorm`), with each expert split over 2 ranks too; the
    # data-parallel size, and so the load-balancing loss's micro-batches, is the reference's
    ref = moe_reference
    split = [f"parallel.expert_tp={expert_tp}"]
    got = run_distributed(_moe_run, world, moe_dir, 2, tp, None, split)[0]
    assert got["layout"]["ep"] == 2 and ref["layout"]["ep"] == 1
    assert got["layout"]["expert_tp"] == expert_tp
    assert got["layout"]["tp"] == tp and got["layout"]["dp"] == ref["layout"]["dp"] == 2
    assert (
        all(abs(x) > 1e-4 for x in ref["grad_norm"])
        and ref["param_checksum"] != ref["initial_checksum"]
    )
    assert_same(got, ref, 1e-5, f"qwen3-moe ep2 tp{tp} etp{expert_tp}")
    for a, b in zip(got["metrics"], ref["metrics"], strict=True):
        assert a["moe/load_balancing_loss"] == pytest.approx(b["moe/load_balancing_loss"], rel=1e-5)
    # every expert's update reaches the export, each from the rank that holds it
    assert ref["update"].keys() == got["update"].keys()
    experts = [n for n in ref["update"] if ".mlp.experts." in n]
    assert len(experts) == 4 * 4 * 3  # layers x experts x (gate, up, down)
    for name in experts:
        (u, n), (u_ref, n_ref) = got["update"][name], ref["update"][name]
        # u = sum(r * d) cancels: its fp32 noise (the dispatch orders tokens differently) is
        # measured against |d|, not against u
        assert n > 0 and n == pytest.approx(n_ref, rel=1e-4), (name, n, n_ref)
        assert abs(u - u_ref) <= 1e-4 * n_ref, (name, u, u_ref, n_ref)


def test_router_losses_enter_the_gradient_and_nothing_else(tmp_path):
    # the same weights and batch with the load-balancing loss off and at a coefficient of 0.5:
    # the policy loss and CW-GRPO's statistics of the first update (same weights) are equal to
    # the bit, the gradient is not, and the router's loss is reported only where it is on
    off = run_distributed(_moe_run, 1, _save_moe(tmp_path / "off", 0.0), 1)[0]
    on = run_distributed(_moe_run, 1, _save_moe(tmp_path / "on", 0.5), 1)[0]
    assert on["loss"][0] == off["loss"][0]
    statistics = [k for k in off["metrics"][0] if k.startswith(("cw/", "actor/", "rollout/"))]
    assert {"cw/sigma", "cw/top1pct_cov_share"} <= set(statistics)
    for key in statistics:
        assert on["metrics"][0][key] == off["metrics"][0][key], key
    assert abs(on["grad_norm"][0] - off["grad_norm"][0]) > 1e-4 * off["grad_norm"][0]
    assert not any(k.startswith("moe/") for k in off["metrics"][0])
    # the switch loss before its coefficient: E * sum_e f_e P_e, 1 when routing is uniform and
    # at most E = 4
    assert 0.0 < on["metrics"][0]["moe/load_balancing_loss"] <= 4.0


def test_router_loss_is_a_mean_over_routed_tokens(moe_dir, tmp_path):
    # with no policy gradient, the step follows the load-balancing loss alone; its weight does
    # not depend on which response tokens the policy loss counts, nor on padding (Megatron's
    # per-token losses would otherwise scale it by routed / counted tokens)
    strong = _save_moe(tmp_path / "strong", 0.5)
    runs = {
        (counted, seq_len): run_distributed(
            _moe_run,
            2,
            strong,
            2,
            1,
            partial(_router_only_batch, counted=counted, seq_len=seq_len),
        )[0]
        for counted, seq_len in ((6, 16), (2, 16), (6, 24))
    }
    ref = runs[6, 16]
    assert all(g > 1e-4 for g in ref["grad_norm"]), ref["grad_norm"]
    assert ref["param_checksum"] != ref["initial_checksum"]
    for key, run in runs.items():
        assert_same(run, ref, 1e-5, f"counted, seq_len = {key}")


def test_packed_expert_parallel_ranks_make_as_many_micro_batches(tmp_path):
    # packed, rank 0 fits its rows in 3 micro-batches and rank 1 needs 8; at EP2 each forward
    # joins the all-to-all, so rank 0 cuts its own into 8 (else it waits for ever). The router
    # loss is off, so the step is that of EP1, packed as each rank likes
    plain = _save_moe(tmp_path / "plain", 0.0)
    budget = [
        "train.max_tokens_per_micro_batch=16",
        "data.max_prompt_tokens=4",
        "rollout.max_tokens=12",
    ]
    ref = run_distributed(_moe_run, 2, plain, 1, 1, _uneven_batch, budget)
    got = run_distributed(_moe_run, 2, plain, 2, 1, _uneven_batch, budget, timeout=120)
    assert ref[0]["micro_batch_counts"] == [3 + 8] * 2  # over both ranks, for each step
    assert got[0]["micro_batch_counts"] == [8 + 8] * 2
    assert_same(got[0], ref[0], 1e-5, "packed ep2")


def test_check_layout_passes_ep2_against_ep1_and_fails_swapped_experts(moe_dir, tmp_path):
    # the reference at the same data-parallel size: the load-balancing loss is Megatron's, over
    # each micro-batch, so its gradient depends on how the rows fall into micro-batches
    def check(name, *args):
        out = str(tmp_path / f"{name}.json")
        return run_tool("check_layout.py", 2, "--hf-dir", moe_dir, "--out", out, *args)

    code, log = check("ref", "--calibrate")
    assert code == 0, log
    ref = str(tmp_path / "ref.json")
    code, log = check("ep2", "--ep", "2", "--against", ref)
    assert code == 0 and "PASS: TP1xPP1xDP2xEP2 against TP1xPP1xDP2" in log, log
    code, swap_log = check("swap", "--ep", "2", "--plant", "experts_swapped", "--against", ref)
    assert code == 1 and "FAIL:" in swap_log, swap_log
    # the routing measured beside the verdict: swapped experts change every later layer's
    # input, so its tokens go elsewhere far more often than the correct run's
    share = [
        float(re.search(r"moe/topk_differ: ([\d.]+)% of rank 0's tokens", text)[1])
        for text in (log, swap_log)
    ]
    print("topk_differ % (ep2, swapped):", share)
    assert share[0] < 1.0 and share[1] > max(1.0, 10 * share[0]), share
    code, log = check("dense", "--plant", "experts_swapped", "--against", ref)
    assert code == 2 and "needs a MoE model (--hf-dir) and parallel.ep > 1" in log, log


def test_check_routing_measures_rerouted_tokens_and_their_gap(moe_dir, tmp_path):
    code, out = run_tool("check_routing.py", 1, "--hf-dir", moe_dir, "--json")
    assert code == 0, out
    r = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    print({k: r[k] for k in ("float32", "bfloat16", "fp32_vs_bf16_trainer")})
    fp32, bf16 = r["float32"], r["bfloat16"]
    # fp32: the two implementations agree to roundings, bf16 to its own precision
    assert fp32["gap_max"] < 1e-5 < bf16["gap_mean"]
    for x in (fp32, bf16):
        # a rerouted token is one whose set differs in at least one layer
        assert x["topk_differ"] <= x["rerouted_tokens"] <= r["setup"]["layers"] * x["topk_differ"]
    from cwgrpo_megatron.checks.tiny import save_tiny_qwen3

    dense = save_tiny_qwen3(tmp_path / "dense")
    code, out = run_tool("check_routing.py", 1, "--hf-dir", str(dense))
    assert code == 2 and "is a dense model" in out, out
