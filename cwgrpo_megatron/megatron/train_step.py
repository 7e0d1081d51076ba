"""The CW-GRPO optimizer step on Megatron-Core (DESIGN section 4, steps 5-9).

Per rollout batch (identical on every rank), for each PPO mini-batch k:

    1. this DP rank's shard of mini-batch k, cut into micro-batches: blocks of
       train.micro_batch_size rows, or rows packed by length up to a token budget (each padded
       to its own longest row; the statistics below see the shard's [b, s] in row order)
    2. forward-only pass -> old log-probs l_old [b, s] on the last stage; for k > 0 a fresh
       pass of the current policy gives the statistics' log-probs
    3. scope statistics -> per-token constant (w~ for cw_grpo): at most 3 tiny all-reduces over
       the DP group on the last stage; no TP reduction (TP ranks hold identical [b, s]
       log-probs) and no PP broadcast (only the last stage has a loss)
    4. forward + backward through Megatron's schedule (1F1B with pp > 1); `loss_func` returns
       (loss_sum, num_tokens, metrics) and Megatron divides gradients by the global count
    5. a non-finite gradient anywhere skips the step (one 1-scalar MAX all-reduce)
    6. optimizer step (gradient clipping inside), LR schedule step

No pass at all (`algo.needs_policy_pass` is False) with one mini-batch (M = 1) when the loss
reads no token_stat (grpo) or the statistics are the engine's (`algo.stats_logp=rollout`): the
training forward is then the policy that l_old must be, so its detached log-probs are l_old,
and grpo's diagnostics (step 3) run after step 4 on them, with the same reductions.

Cost of several mini-batches: mini-batch 0 reuses the rollout's forward-only pass; each later
one runs one more forward-only pass over its rows, i.e. (M - 1) / M extra forward passes of the
rollout batch for M mini-batches.

Reference policy (kl_beta > 0): a frozen copy of the initial weights with the same layout, run
forward-only; it costs one more copy of this rank's parameters (params_dtype bytes, no
gradients, no optimizer state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
)

from cwgrpo_megatron.algo import PolicyBatch, PolicyLoss, build_policy_loss, needs_policy_pass
from cwgrpo_megatron.algo.config import AlgoConfig
from cwgrpo_megatron.algo.metrics import Metrics, finalize, histograms, mean_metric, merge
from cwgrpo_megatron.comm import (
    broadcast_object,
    make_scope,
    max_over,
    reduce_metrics,
    sum_over,
    vocab_parallel_logprob_entropy,
)
from cwgrpo_megatron.common.timing import PhaseTimer
from cwgrpo_megatron.config import OptimConfig, TrainConfig
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.data.batching import MicroBatch, TrainBatch
from cwgrpo_megatron.megatron.cpu import on_cpu
from cwgrpo_megatron.megatron.forward import forward_only
from cwgrpo_megatron.megatron.model import DTYPES, build_model, sequence_multiple

log = logging.getLogger(__name__)


def device() -> torch.device:
    """Where this rank's model and batch live: its GPU under CUDA (NCCL needs device tensors),
    else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Actor:
    """The policy being trained on this rank, with the settings its step reads."""

    train: TrainConfig
    algo: AlgoConfig
    optim: OptimConfig
    arch: ModelArch
    model: DistributedDataParallel
    optimizer: object
    scheduler: OptimizerParamScheduler
    ref_model: object | None = None
    step: int = 0
    skipped_steps: int = 0
    sequence_multiple: int = 1
    """Micro-batches are padded to a multiple of this many tokens (`model.sequence_multiple`:
    tp under sequence parallelism)."""
    loss: PolicyLoss | None = None
    """algo.policy_loss with its options (`algo.build_policy_loss`)."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    metrics: dict[str, float] = field(default_factory=dict)
    """The loss's finalized metrics (`algo.metrics`), on every rank."""
    histograms: dict[str, list[float]] = field(default_factory=dict)
    """The loss's reduced histograms (`algo.metrics.histograms`: bin counts of c), on every
    rank."""
    lr: float = float("nan")
    """The learning rate this step used."""
    padded_tokens: int = 0
    """Token positions the forward and backward passes ran over (rows x micro-batch length),
    summed over data-parallel ranks: what padding costs, next to the loss's token count."""
    micro_batches: int = 0
    """Micro-batches of the update, summed over data-parallel ranks."""


def build_actor(
    arch: ModelArch,
    load_weights,
    *,
    train: TrainConfig,
    algo: AlgoConfig,
    optim: OptimConfig,
) -> Actor:
    """Model (loaded by `load_weights(model)`), DDP, optimizer and LR schedule on this rank."""
    dtype = DTYPES[train.params_dtype]
    # packed micro-batches differ in shape: pipeline stages then exchange shapes first
    variable = {}
    if train.max_tokens_per_micro_batch is not None:
        # Megatron refuses its default token dispatcher beside the flag (alltoall is also the
        # one a MoE model uses: `model.moe_settings`)
        variable = {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}
    model = build_model(
        arch,
        params_dtype=dtype,
        calculate_per_token_loss=True,
        **variable,
        **train.recompute_overrides(),
    )
    load_weights(model)
    ref_model = None
    if algo.kl_beta > 0:
        ref_model = build_model(arch, params_dtype=dtype, perform_initialization=False, **variable)
        ref_model.load_state_dict(model.state_dict())
        ref_model.eval().requires_grad_(False)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    with on_cpu():
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        optimizer = get_megatron_optimizer(_optimizer_config(optim, train.params_dtype), [ddp])
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    model.config.grad_scale_func = optimizer.scale_loss
    o, total = optim, train.optimizer_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_ratio > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.lr * o.min_lr_ratio,
        lr_warmup_steps=int(o.warmup_ratio * total),
        lr_decay_steps=total,
        lr_decay_style="cosine",
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    return Actor(
        train,
        algo,
        optim,
        arch,
        ddp,
        optimizer,
        scheduler,
        ref_model,
        sequence_multiple=sequence_multiple(ddp),
        loss=build_policy_loss(algo),
    )


def _optimizer_config(o: OptimConfig, params_dtype: str) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.lr * o.min_lr_ratio,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=0.0,
        clip_grad=o.clip_grad,
        bf16=params_dtype == "bfloat16",
        params_dtype=DTYPES[params_dtype],
        use_distributed_optimizer=o.use_distributed_optimizer,
    )


# ---- the pieces of a step ------------------------------------------------------------------


def label_logprobs(logits, labels, *, temperature: float, arch: ModelArch):
    """(logp, entropy) `[b, s]` of `labels` under this rank's logits shard `[b, s, V/tp]` at the
    sampling temperature (reductions over the TP group)."""
    return vocab_parallel_logprob_entropy(
        logits,
        labels,
        group=parallel_state.get_tensor_model_parallel_group(),
        temperature=temperature,
        vocab_size=arch.vocab_size,
    )


def micro_batches(local: TrainBatch, t: TrainConfig, *, multiple: int = 1) -> list[MicroBatch]:
    """This shard's micro-batches: blocks of train.micro_batch_size rows, or rows packed up to
    train.max_tokens_per_micro_batch tokens; lengths a multiple of `multiple`. Packed, the
    ranks of an expert-parallel group (whose every forward joins one all-to-all) make as many
    as the group's most: one 1-scalar MAX all-reduce over it."""
    at_least = 1
    if t.max_tokens_per_micro_batch is not None and _expert_group_size() > 1:
        own = local.micro_batches(max_tokens=t.max_tokens_per_micro_batch, multiple=multiple)
        count = torch.tensor([len(own)], device=local.tokens.device)
        at_least = int(max_over(count, parallel_state.get_expert_tensor_and_model_parallel_group()))
    return local.micro_batches(
        size=t.micro_batch_size,
        max_tokens=t.max_tokens_per_micro_batch,
        multiple=multiple,
        at_least=at_least,
    )


def _expert_group_size() -> int:
    """Ranks sharing an expert-parallel (and expert-TP) all-to-all; 1 for a dense model."""
    return parallel_state.get_expert_tensor_and_model_parallel_world_size()


def logprobs(model, local: TrainBatch, plan: list[MicroBatch], *, temperature: float, arch):
    """(logp, entropy) `[b, s]` of the labels at the sampling temperature, in `local`'s row
    order (0 past a packed row's micro-batch length); last stage only."""
    micro = [local.gather(m) for m in plan]

    def score(logits, i):
        return label_logprobs(logits, micro[i].labels, temperature=temperature, arch=arch)

    out = forward_only(model, [m.tokens for m in micro], score)
    if out is None:
        return None, None
    return _unpack([lp for lp, _ in out], plan, local), _unpack([h for _, h in out], plan, local)


def _unpack(parts: list[torch.Tensor], plan: list[MicroBatch], local: TrainBatch):
    """Micro-batch pieces `[m, length]` back into one `[b, s]` tensor in row order."""
    full = parts[0].new_zeros(local.tokens.shape)
    for part, m in zip(parts, plan, strict=True):
        full[m.rows, : m.length] = part
    return full


def _pieces(tensor: torch.Tensor | None, plan: list[MicroBatch]) -> list:
    """`tensor [b, s]` cut as the micro-batches are, or Nones where a stage has no such tensor."""
    if tensor is None:
        return [None] * len(plan)
    return [tensor[m.rows, : m.length] for m in plan]


@dataclass
class MicroInputs:
    """What one micro-batch's loss reads besides its logits: `[m, length]` pieces."""

    batch: TrainBatch
    old_logp: torch.Tensor | None
    """None: the training forward's own detached log-probs (one mini-batch, no pass)."""
    token_stat: torch.Tensor | None
    ref_logp: torch.Tensor | None


def micro_batch_loss(
    output_tensor: torch.Tensor,
    micro: MicroInputs,
    loss: PolicyLoss,
    algo: AlgoConfig,
    *,
    temperature: float,
    arch,
):
    """(the policy loss `loss` of one micro-batch from this rank's logits shard
    `[m, length, V/tp]` (`algo.losses.LossOutput`), its detached log-probs `[m, length]`)."""
    b = micro.batch
    logp, entropy = label_logprobs(output_tensor, b.labels, temperature=temperature, arch=arch)
    detached = logp.detach()
    out = loss(
        PolicyBatch(
            logp=logp,
            old_logp=detached if micro.old_logp is None else micro.old_logp,
            advantages=b.advantages,
            mask=b.loss_mask,
            token_stat=micro.token_stat,
            ref_logp=micro.ref_logp,
            entropy=entropy.detach(),
            rollout_logp=b.rollout_logp,
        ),
        algo,
    )
    return out, detached


def _loss_func(micro: MicroInputs, actor: Actor, output_tensor: torch.Tensor):
    out, logp = micro_batch_loss(
        output_tensor,
        micro,
        actor.loss,
        actor.algo,
        temperature=actor.train.temperature,
        arch=actor.arch,
    )
    # the schedule divides loss_sum in place: report copies
    report = {"loss_sum": out.loss_sum.detach().clone(), "count": out.num_tokens.detach().clone()}
    report |= {"metrics": out.metrics, "logp": logp}
    return out.loss_sum, out.num_tokens.to(torch.int), report


def _forward_backward(actor: Actor, micro: list[MicroInputs]) -> list[dict]:
    def forward_step(data_iterator, model_chunk):
        m = next(data_iterator)
        routed = {}
        if actor.arch.is_moe:  # the routers' losses leave out padding (True = padding)
            routed["padding_mask"] = m.batch.position_ids >= m.batch.lengths[:, None]
        output = model_chunk(m.batch.tokens, m.batch.position_ids, attention_mask=None, **routed)
        return output, partial(_loss_func, m, actor)

    # with packed micro-batches the shapes vary: the pipeline then sends them first
    # (variable_seq_lengths); these are the largest, as the schedule's buffers need
    mbs = max(m.batch.tokens.shape[0] for m in micro)
    s = max(m.batch.tokens.shape[1] for m in micro)
    with on_cpu():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[actor.model],
            num_microbatches=len(micro),
            seq_length=s,
            micro_batch_size=mbs,
            forward_only=False,
        )


def _grads_finite(actor: Actor) -> bool:
    """True when every gradient on every rank is finite: device-side checks, one MAX
    all-reduce of 1 scalar, one host sync."""
    grads = [
        p.main_grad for p in actor.model.parameters() if getattr(p, "main_grad", None) is not None
    ]
    bad = torch.zeros((), dtype=torch.float32, device=device())
    if grads:
        bad = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).float()
    return bool(max_over(bad, dist.group.WORLD) == 0)


# ---- the step --------------------------------------------------------------------------------


def train_step(
    actor: Actor, rollout: TrainBatch, *, timer: PhaseTimer | None = None
) -> list[StepResult]:
    """All PPO mini-batch updates of one rollout batch; one StepResult per optimizer step.

    `rollout` is the whole rollout batch, identical on every rank. `timer` receives the
    forward-only passes (old, statistics and reference log-probs; none where
    `needs_policy_pass` is False and there is no reference model) as "old_logp" and the
    training passes and optimizer steps as "train".
    """
    timer = timer or PhaseTimer()
    rollout = rollout.to(device())
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    # sequence parallelism splits each micro-batch's sequence over the TP ranks
    multiple = actor.sequence_multiple
    mini_batches = [
        m.shard(dp_rank, dp_size).padded_to(multiple)
        for m in rollout.split(actor.train.ppo_mini_batches)
    ]
    plans = [micro_batches(m, actor.train, multiple=multiple) for m in mini_batches]
    score = partial(logprobs, temperature=actor.train.temperature, arch=actor.arch)
    policy_pass = needs_policy_pass(actor.algo, len(mini_batches))
    # l_old of every mini-batch comes from the policy before this rollout's first update
    # (None: the one mini-batch's training forward, which is that policy)
    old = [None] * len(mini_batches)
    if policy_pass:
        with timer("old_logp"):
            old = [score(actor.model, m, p)[0] for m, p in zip(mini_batches, plans, strict=True)]
    results = []
    for k, (local, plan) in enumerate(zip(mini_batches, plans, strict=True)):
        with timer("old_logp"):
            # the statistics are those of the policy about to be updated (None: computed
            # after the training pass from its log-probs)
            if actor.algo.stats_logp == "rollout":
                policy_logp = _engine_logp(local)
            else:
                policy_logp = old[k] if k == 0 else score(actor.model, local, plan)[0]
            ref_logp = None
            if actor.ref_model is not None:
                ref_logp = score(actor.ref_model, local, plan)[0]
        with timer("train"):
            results.append(_update(actor, local, plan, old[k], policy_logp, ref_logp))
    return results


def probe_entropy(actor: Actor, probe: TrainBatch) -> float:
    """The policy's mean token entropy on fixed sequences `probe` (the whole set, identical on
    every rank), teacher-forced at the sampling temperature, with no sampling noise:

        H = sum_t m_t H_t / sum_t m_t,   H_t = -sum_v p_v log p_v   (over the counted tokens)

    One forward-only pass over this rank's block of rows (its per-token entropy reduced over
    the TP vocabulary shards), one SUM all-reduce over DP, a broadcast from the last pipeline
    stage."""
    multiple = actor.sequence_multiple
    local = (
        probe.to(device())
        .shard(
            parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        )
        .padded_to(multiple)
    )
    plan = micro_batches(local, actor.train, multiple=multiple)
    _, entropy = logprobs(
        actor.model, local, plan, temperature=actor.train.temperature, arch=actor.arch
    )
    value = None
    if entropy is not None:
        parts = {"probe/entropy": mean_metric(entropy, local.loss_mask)}
        reduced = reduce_metrics(parts, group=parallel_state.get_data_parallel_group())
        value = float(finalize(reduced)["probe/entropy"])
    return broadcast_object(
        value,
        parallel_state.get_pipeline_model_parallel_last_rank(),
        parallel_state.get_pipeline_model_parallel_group(),
    )


def _engine_logp(local: TrainBatch) -> torch.Tensor:
    if local.rollout_logp is None:
        raise ValueError(
            "algo.stats_logp=rollout needs the engine's sampling log-probs, and this batch has "
            "none: use algo.stats_logp=trainer"
        )
    return local.rollout_logp


def _prepare(actor: Actor, local: TrainBatch, plan, policy_logp, old_logp):
    """`actor.loss.prepare` on this rank's shard `[b, s]` with the configured scope (its
    reductions over the DP group); last stage only."""
    dev = device()
    scope = make_scope(
        actor.algo.cov_scope,
        batch_size=local.rows,
        group=parallel_state.get_data_parallel_group(),
        prompt_index=local.prompt_index,
        micro_batch_index=_micro_batch_index(plan, local.rows, dev),
        # shards are consecutive blocks of the mini-batch, so this is the global row order
        row_order=parallel_state.get_data_parallel_rank() * local.rows
        + torch.arange(local.rows, device=dev),
        device=dev,
    )
    generator = torch.Generator().manual_seed(actor.train.seed * 1_000_003 + actor.step)
    return actor.loss.prepare(
        policy_logp,
        local.advantages,
        local.loss_mask,
        scope=scope,
        cfg=actor.algo,
        old_logp=old_logp,
        generator=generator,
    )


def _update(actor: Actor, local, plan, old_logp, policy_logp, ref_logp) -> StepResult:
    """One optimizer step on mini-batch `local`. `policy_logp` None: the loss reads no
    token_stat, and its diagnostics come from the training pass's log-probs."""
    last = parallel_state.is_pipeline_last_stage()
    token_stat, prepared_metrics = None, {}
    if last and policy_logp is not None:
        token_stat, prepared_metrics = _prepare(actor, local, plan, policy_logp, old_logp)
    micro_inputs = [
        MicroInputs(*parts)
        for parts in zip(
            [local.gather(m) for m in plan],
            _pieces(old_logp, plan),
            _pieces(token_stat, plan),
            _pieces(ref_logp, plan),
            strict=True,
        )
    ]
    actor.model.zero_grad_buffer()
    actor.optimizer.zero_grad()
    if actor.arch.is_moe:
        _scale_router_losses(actor, local)
    clear_aux_losses_tracker()
    outputs = _forward_backward(actor, micro_inputs)
    if last and policy_logp is None:
        trained = _unpack([o["logp"] for o in outputs], plan, local)
        after = _prepare(actor, local, plan, trained, old_logp)
        if after.token_stat is not None:
            raise TypeError(
                f"policy loss {actor.loss.name!r} returned a token_stat from prepare() but "
                "declares uses_token_stat = False, so the step ran without it: set "
                "uses_token_stat = True on the class"
            )
        prepared_metrics = after.metrics
    padded = float(sum(m.padded_tokens for m in plan))
    totals, metrics, hists = _reduce_outputs(outputs, prepared_metrics, last, (padded, len(plan)))
    if actor.arch.is_moe:
        metrics.update(_router_losses(len(plan)))
    finite = _grads_finite(actor)
    grad_norm = float("nan")
    lr = float(actor.optimizer.param_groups[0]["lr"])
    if finite:
        with on_cpu():
            _, grad_norm, _ = actor.optimizer.step()
        actor.scheduler.step(increment=1)
    else:
        actor.skipped_steps += 1
        log.warning("step %d skipped: non-finite gradient", actor.step)
    actor.step += 1
    return StepResult(
        loss=totals["loss"],
        grad_norm=float(grad_norm),
        skipped=not finite,
        metrics=metrics,
        histograms=hists,
        lr=lr,
        padded_tokens=int(totals["padded_tokens"]),
        micro_batches=int(totals["micro_batches"]),
    )


ROUTER_LOSS_NAMES = {"load_balancing_loss": "moe/load_balancing_loss"}
"""The logged name of the loss Megatron's router tracker holds for `aux_loss` balancing (any
other it holds is logged as moe/<its name>)."""


def _scale_router_losses(actor: Actor, local: TrainBatch) -> None:
    """Weight the routers' load-balancing loss like a mean over routed tokens.

    Megatron's per-token losses give micro-batch j's router loss L_j (over its T_j routed
    tokens: prompt and response, not padding) the gradient weight c T_j, and divide every
    gradient by the count N of the policy loss's tokens. The coefficient is set to
    c' = c N / T, with N and T the mini-batch's counts over every data-parallel rank, so the
    gradient is c sum_j T_j grad L_j / T: independent of the loss mask (overlong masking, the
    prompt's length) and of padding. One all-reduce of 2 scalars over the DP group."""
    counts = torch.stack([local.loss_mask.sum(), local.lengths.sum()]).to(torch.float64)
    counted, routed = sum_over(counts, parallel_state.get_data_parallel_group()).tolist()
    coefficient = actor.arch.moe_aux_loss_coeff * counted / max(routed, 1.0)
    # the routers read it at each forward (and at a recomputed one) from the shared config
    actor.model.config.moe_aux_loss_coeff = coefficient


def _router_losses(micro_batches: int) -> dict[str, float]:
    """`moe/<name>` for each loss Megatron's MoE routers added to this update's backward pass
    (`moe/load_balancing_loss`: the switch loss before its coefficient), averaged over the MoE
    layers, the micro-batches and the data-parallel ranks. They enter the gradient only, not
    the policy loss or its statistics. Collective over PP and DP (Megatron's reduction of its
    tracker, which is then cleared)."""
    tracker = get_moe_layer_wise_logging_tracker()
    with on_cpu():
        reduce_aux_losses_tracker_across_ranks()
    out = {
        ROUTER_LOSS_NAMES.get(name, f"moe/{name}"): float(entry["values"].sum())
        / (entry["values"].numel() * micro_batches)
        for name, entry in sorted(tracker.items())
    }
    clear_aux_losses_tracker()
    return out


def _micro_batch_index(plan: list[MicroBatch], rows: int, dev) -> torch.Tensor:
    """`[b]` the micro-batch of each row (the layout-dependent micro_batch scope)."""
    index = torch.empty(rows, dtype=torch.long, device=dev)
    for j, m in enumerate(plan):
        index[m.rows] = j
    return index


def _reduce_outputs(outputs: list[dict], prepared: Metrics, last: bool, shape: tuple):
    """Global loss and metrics, reduced over DP on the last stage, then sent to every stage
    (rank 0 logs them, and it is the first stage when pp > 1). `shape` = (padded tokens,
    micro-batches) of this rank. Returns ({loss, padded_tokens, micro_batches}, the loss's
    metrics, its histograms)."""
    values: dict[str, float] = {}
    hists: dict[str, list[float]] = {}
    if last:
        dp_group = parallel_state.get_data_parallel_group()
        merged: Metrics = dict(prepared)
        for out in outputs:
            merged = merge(merged, out["metrics"])
        totals = torch.stack(
            [
                sum(o["loss_sum"].double() for o in outputs),
                sum(o["count"].double() for o in outputs),
                *torch.tensor(shape, dtype=torch.float64, device=device()),
            ]
        )
        totals = sum_over(totals, dp_group)
        reduced = reduce_metrics(merged, group=dp_group)
        final, vectors = finalize(reduced), histograms(reduced)
        names, hist_names = sorted(final), sorted(vectors)
        head = [totals[0] / totals[1].clamp(min=1), totals[2], totals[3]]
        stacked = torch.cat(
            [torch.stack(head + [final[n].double() for n in names])]
            + [vectors[n].double() for n in hist_names]
        ).tolist()  # the one host sync
        offset = len(names) + 3
        keys = ["loss", "padded_tokens", "micro_batches", *names]
        values = dict(zip(keys, stacked[:offset], strict=True))
        for n in hist_names:
            hists[n] = stacked[offset : offset + vectors[n].numel()]
            offset += vectors[n].numel()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    values, hists = broadcast_object(
        (values, hists), parallel_state.get_pipeline_model_parallel_last_rank(), pp_group
    )
    totals = {k: values.pop(k) for k in ("loss", "padded_tokens", "micro_batches")}
    return totals, values, hists


def param_checksum(model) -> float:
    """Float64 sum of every logical parameter once: TP shards add up, TP-replicated tensors
    count on tp rank 0 only, DP replicas on dp rank 0 only, and a tied output layer (the last
    stage's copy of the embedding when pp > 1) not at all; an expert's parameters likewise
    over the expert-TP and expert-data-parallel groups. Summed over all ranks."""
    gpt = getattr(model, "module", model)
    tied = getattr(gpt, "share_embeddings_and_output_weights", False)
    total = torch.zeros((), dtype=torch.float64, device=device())
    dense = (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    expert = (
        parallel_state.get_expert_data_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )
    for name, p in gpt.named_parameters():
        dp_rank, tp_rank = expert if ".experts." in name else dense
        if dp_rank != 0 or (not getattr(p, "tensor_model_parallel", False) and tp_rank != 0):
            continue
        if tied and name == "output_layer.weight":
            continue
        total += p.detach().double().sum()
    return float(sum_over(total, dist.group.WORLD))
