"""Run real CW-GRPO train steps on a fixed synthetic batch and summarise them per layout.

The batch, the model weights and the config depend only on the seed, never on the layout, so
the summaries of two layouts must agree (to fp32 precision with SGD). `tools/check_layout.py`
is the CLI; the distributed tests call `run` directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from cwgrpo_megatron.checks.symmetry import ChannelPermutation
from cwgrpo_megatron.checks.tiny import tiny_qwen2
from cwgrpo_megatron.comm import job_rank
from cwgrpo_megatron.config import Config, load_config
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.data.batching import synthetic_batch
from cwgrpo_megatron.megatron import parallel
from cwgrpo_megatron.megatron.model import load_hf_weights
from cwgrpo_megatron.megatron.publish import hf_weights, in_engine_group
from cwgrpo_megatron.megatron.routing import recorded_routing
from cwgrpo_megatron.megatron.train_step import (
    build_actor,
    param_checksum,
    probe_entropy,
    train_step,
)


def hf_source(*, seed: int = 0, hf_dir: str | None = None, num_layers: int | None = None):
    """(arch, get) of the checkpoint in `hf_dir` or of the tiny random Qwen2; `get(name)` gives
    an HF tensor. `num_layers` keeps the first layers only (the rest is never read)."""
    if hf_dir:
        from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint

        arch, get = ModelArch.from_hf_dir(hf_dir), HFCheckpoint(hf_dir).get
    else:
        hf = tiny_qwen2(seed)
        state = hf.state_dict()
        arch, get = ModelArch.from_hf_dict(hf.config.to_dict()), state.__getitem__
    if num_layers is not None:
        if not 1 <= num_layers <= arch.num_layers:
            raise ValueError(f"num_layers {num_layers}: the model has layers 1..{arch.num_layers}")
        arch = dataclasses.replace(arch, num_layers=num_layers)
    return arch, get


def tiny_actor(
    cfg: Config,
    *,
    seed: int = 0,
    hf_dir: str | None = None,
    init_parallel: bool = True,
    source: tuple[ModelArch, Callable[[str], torch.Tensor]] | None = None,
):
    """(actor, arch) at cfg's layout, weights from `hf_dir` or the tiny random Qwen2, or from
    `source` = (arch, get) when given (`hf_source`'s result, perhaps with `get` wrapped).

    Sets up Megatron's groups unless `init_parallel` is False (a second actor in the same
    groups); call `parallel.destroy()` when done."""
    arch, get = source if source is not None else hf_source(seed=seed, hf_dir=hf_dir)
    if init_parallel:
        parallel.initialize(**cfg.parallel.sizes(), seed=cfg.train.seed)
    try:
        actor = build_actor(
            arch,
            lambda model: load_hf_weights(model, arch, get),
            train=cfg.train,
            algo=cfg.algo,
            optim=cfg.optim,
        )
        return actor, arch
    except BaseException:
        if init_parallel:
            parallel.destroy()
        raise


def layout_config(
    *,
    tp: int,
    pp: int,
    micro_batches: int,
    global_batch: int,
    group_size: int,
    steps: int,
    world_size: int,
    mini_batches: int = 1,
    overrides: Sequence[str] = (),
) -> Config:
    """The run's config: SGD without clipping or schedule unless `overrides` say otherwise.

    `micro_batches` counts the micro-batches of one data-parallel rank per mini-batch.
    """
    if global_batch % group_size:
        raise ValueError(
            f"global batch {global_batch} is not a multiple of group size {group_size}"
        )
    dp = max(world_size // (tp * pp), 1)
    rows = global_batch // dp // mini_batches
    if rows % micro_batches:
        raise ValueError(f"{rows} rows per rank do not split into {micro_batches} micro-batches")
    defaults = [
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        "algo.policy_loss=cw_grpo",
        "algo.cov_scope=global",
        f"train.prompts_per_step={global_batch // group_size}",
        f"train.group_size={group_size}",
        f"train.total_steps={steps}",
        f"train.ppo_mini_batches={mini_batches}",
        f"train.micro_batch_size={rows // micro_batches}",
        "train.temperature=1.0",
        "optim.optimizer=sgd",
        "optim.lr=0.05",
        "optim.warmup_ratio=0",
        "optim.min_lr_ratio=1.0",
        "optim.clip_grad=0",
    ]
    cfg = load_config(overrides=defaults + list(overrides))
    cfg.check_world(world_size)
    return cfg


PLANTS = ("kv_heads_misplaced", "dp_grad_unreduced", "experts_swapped")
"""Errors `run(plant=...)` builds in on purpose, the negative controls of the check:

- kv_heads_misplaced: tensor-parallel rank r loads the KV heads of rank r + 1 (mod tp), as a
  loader with an off-by-one shard index would (needs tp > 1);
- dp_grad_unreduced: the gradient all-reduce over data parallelism is skipped, so each replica
  steps on its own part of the batch (needs dp > 1);
- experts_swapped: expert-parallel rank r loads the experts of rank r + 1 (mod ep) while the
  router keeps its order, as an off-by-one expert shard index would (a MoE model, ep > 1)."""

CLIP = 1e-4
"""The clip norm behind `rel_step`: below every gradient norm a real loss gives, so the clip
always acts and the step is lr x CLIP x g / |g|."""


def run(
    *,
    tp: int = 1,
    pp: int = 1,
    micro_batches: int = 1,
    global_batch: int = 24,
    group_size: int = 4,
    seq_len: int = 24,
    steps: int = 2,
    mini_batches: int = 1,
    seed: int = 0,
    hf_dir: str | None = None,
    num_layers: int | None = None,
    rel_step: float | None = None,
    permute_seed: int | None = None,
    plant: str | None = None,
    overrides: Sequence[str] = (),
    batch_fn=None,
) -> dict:
    """`steps` rollout batches of `mini_batches` optimizer steps each, at tp x pp
    (dp = world / (tp pp)); needs torch.distributed.

    rel_step: each optimizer step is a normalised SGD step of norm rel_step x |theta_0|
        (lr = rel_step |theta_0| / CLIP, clip norm CLIP), whatever the gradient's size; None
        keeps layout_config's SGD at lr 0.05 (or what `overrides` say).
    permute_seed: load the model through `ChannelPermutation(arch, permute_seed)`: the same
        function with other reduction orders (the calibration runs of the verdict).
    plant: one of PLANTS, an error built in on purpose.

    Returns on every rank {"loss": [...], "grad_norm": [...], "param_checksum": float,
    "layout": {...}, "skipped": [...], "metrics": [...], "probe_entropy": [...]} (the last
    one value per step before its update with run.probe_groups in `overrides`, else empty),
    for a MoE model "routing" (this rank's top-k expert ids of every router call,
    `routing.recorded_routing`, as lists), and on rank 0 "update": {hf_name: [u, n]} per HF
    tensor for the change d = theta_end - theta_0 (in the unpermuted model): u = sum(r * d)
    for a fixed Gaussian r seeded by the name, n = |d|. `batch_fn(step, arch)` may replace the
    synthetic batch.
    """
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"unknown plant {plant!r}; choose from {', '.join(PLANTS)}")
    arch, get = hf_source(seed=seed, hf_dir=hf_dir, num_layers=num_layers)
    extra = list(overrides)
    if rel_step is not None:
        lr = rel_step * hf_norm(arch, get) / CLIP
        extra = [f"optim.lr={lr!r}", f"optim.clip_grad={CLIP!r}", *extra]
    world = dist.get_world_size()
    cfg = layout_config(
        tp=tp,
        pp=pp,
        micro_batches=micro_batches,
        global_batch=global_batch,
        group_size=group_size,
        steps=steps,
        world_size=world,
        mini_batches=mini_batches,
        overrides=extra,
    )
    dp = world // (tp * pp)
    if plant == "kv_heads_misplaced" and tp == 1:
        raise ValueError("plant kv_heads_misplaced needs tp > 1")
    if plant == "dp_grad_unreduced" and dp == 1:
        raise ValueError("plant dp_grad_unreduced needs data parallelism (world > tp x pp)")
    ep = cfg.parallel.ep
    if plant == "experts_swapped" and (not arch.is_moe or ep == 1):
        raise ValueError("plant experts_swapped needs a MoE model (--hf-dir) and parallel.ep > 1")
    if plant == "experts_swapped":
        get = _swap_experts(arch, ep, get)
    perm = ChannelPermutation(arch, permute_seed) if permute_seed is not None else None
    transforms = [t for t in (
        perm.apply if perm else None,
        _misplace_kv_heads(arch, tp) if plant == "kv_heads_misplaced" else None,
    ) if t is not None]  # fmt: skip

    def transformed(name):
        tensor = get(name)
        for t in transforms:
            tensor = t(name, tensor)
        return tensor

    actor, arch = tiny_actor(cfg, source=(arch, transformed))
    try:
        if plant == "dp_grad_unreduced":
            actor.model.finish_grad_sync = lambda *a, **k: None
        start = _hf_snapshot(actor.model, arch)
        initial = param_checksum(actor.model)
        losses, norms, skipped, metrics, padded, counts, probes = [], [], [], [], [], [], []
        probe = None
        routing = recorded_routing(actor.model) if arch.is_moe else contextlib.nullcontext()
        with routing as calls:
            for step in range(steps):
                if batch_fn is not None:
                    batch = batch_fn(step, arch)
                else:
                    batch = synthetic_batch(
                        prompts=global_batch // group_size,
                        group_size=group_size,
                        seq_len=seq_len,
                        vocab_size=arch.vocab_size,
                        seed=seed * 1000 + step,
                    )
                if perm is not None:
                    batch = dataclasses.replace(
                        batch, tokens=perm.tokens(batch.tokens), labels=perm.tokens(batch.labels)
                    )
                if cfg.run.probe_groups:  # the trainer's probe: step 1's first groups, fixed
                    if probe is None:
                        probe = batch.select(slice(0, cfg.run.probe_groups * group_size))
                    probes.append(probe_entropy(actor, probe))
                for result in train_step(actor, batch):
                    losses.append(result.loss)
                    norms.append(result.grad_norm)
                    skipped.append(result.skipped)
                    metrics.append(result.metrics)
                    padded.append(result.padded_tokens)
                    counts.append(result.micro_batches)
        out = {
            "loss": losses,
            "grad_norm": norms,
            "param_checksum": param_checksum(actor.model),
            "initial_checksum": initial,
            "skipped": skipped,
            "metrics": metrics,
            "padded_tokens": padded,
            "micro_batch_counts": counts,
            "probe_entropy": probes,
            "layout": {**parallel.layout(), "micro_batches": micro_batches},
        }
        if calls is not None:
            out["routing"] = [ids.tolist() for ids in calls]
        update = _update_stats(actor.model, arch, start, perm)
        if update is not None:
            out["update"] = update
        return out
    finally:
        parallel.destroy()


def hf_norm(arch: ModelArch, get) -> float:
    """|theta| over the HF tensors, a tied output layer counted once (float64)."""
    from cwgrpo_megatron.convert.mapping import hf_shapes

    total = 0.0
    for name in hf_shapes(arch):
        total += float(get(name).double().pow(2).sum())
    return math.sqrt(total)


def _misplace_kv_heads(arch: ModelArch, tp: int):
    """HF-space view of a TP loader off by one rank on K and V: the kv heads of rank r + 1
    land on rank r (q keeps its heads, so every rank attends with another rank's keys)."""
    if arch.num_kv_heads % tp:
        raise ValueError(f"plant kv_heads_misplaced needs tp ({tp}) to divide the KV heads")
    per_rank = arch.num_kv_heads // tp * arch.head_dim

    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            return torch.roll(tensor, shifts=-per_rank, dims=0)
        return tensor

    return transform


def _swap_experts(arch: ModelArch, ep: int, get):
    """`get` with expert e's tensors read from expert e + E / ep (mod E): each EP rank holds
    the next rank's experts."""
    shift = arch.num_experts // ep

    def swapped(name: str) -> torch.Tensor:
        m = _EXPERT.match(name)
        if m is None:
            return get(name)
        other = (int(m.group(2)) + shift) % arch.num_experts
        return get(f"{m.group(1)}{other}{m.group(3)}")

    return swapped


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)$")


def _hf_snapshot(model, arch: ModelArch) -> dict[str, torch.Tensor] | None:
    """Global rank 0's copy of the full HF tensors; a collective over TP x PP of data-parallel
    rank 0 (None on every other rank)."""
    if not in_engine_group():
        return None
    keep = job_rank() == 0
    snap = {}
    for name, tensor in hf_weights(model, arch, dtype="float32"):
        if keep:
            snap[name] = tensor.detach().cpu().clone()
    return snap if keep else None


def _update_stats(model, arch, start, perm: ChannelPermutation | None) -> dict | None:
    """{hf_name: [sum(r * d), |d|]} on rank 0 (see `run`); None on other ranks."""
    end = _hf_snapshot(model, arch)
    if end is None:
        return None
    stats = {}
    for name, tensor in end.items():
        d = tensor.double() - start[name].double()
        if perm is not None:
            d = perm.invert(name, d)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        r = torch.randn(d.shape, generator=gen, dtype=torch.float64)
        stats[name] = [float((r * d).sum()), float(d.norm())]
    return stats
