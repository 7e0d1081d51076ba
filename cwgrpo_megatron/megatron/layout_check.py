"""Run real CW-GRPO train steps on a fixed synthetic batch and summarise them per layout.

The batch, the model weights and the config depend only on the seed, never on the layout, so
the summaries of two layouts must agree (to fp32 precision with SGD). `tools/check_layout.py`
is the CLI; the distributed tests call `run` directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cwgrpo_megatron.config import Config, load_config
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.data.batching import synthetic_batch
from cwgrpo_megatron.megatron import parallel
from cwgrpo_megatron.megatron.model import load_hf_weights
from cwgrpo_megatron.megatron.train_step import build_actor, param_checksum, train_step

TINY_QWEN2 = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=1000,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    architectures=["Qwen2ForCausalLM"],
)


def tiny_qwen2(seed: int):
    """A tiny random Qwen2 built with transformers from a config (nothing downloaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2))


def tiny_trainer(
    cfg: Config, *, seed: int = 0, hf_dir: str | None = None, init_parallel: bool = True
):
    """(trainer, arch) at cfg's layout, weights from `hf_dir` or the tiny random Qwen2.

    Sets up Megatron's groups unless `init_parallel` is False (a second trainer in the same
    groups); call `parallel.destroy()` when done."""
    if hf_dir:
        from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint

        arch, get = ModelArch.from_hf_dir(hf_dir), HFCheckpoint(hf_dir).get
    else:
        hf = tiny_qwen2(seed)
        state = hf.state_dict()
        arch, get = ModelArch.from_hf_dict(hf.config.to_dict()), state.__getitem__
    if init_parallel:
        parallel.initialize(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.train.seed)
    try:
        return build_actor(cfg, arch, lambda model: load_hf_weights(model, arch, get)), arch
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
        f"train.total_steps={steps * mini_batches}",
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
    overrides: Sequence[str] = (),
    batch_fn=None,
) -> dict:
    """`steps` rollout batches of `mini_batches` optimizer steps each, at tp x pp
    (dp = world / (tp pp)); needs torch.distributed.

    Returns {"loss": [...], "grad_norm": [...], "param_checksum": float, "layout": {...},
    "skipped": [...], "metrics": [...]} on every rank. `batch_fn(step, arch)` may replace the
    synthetic batch.
    """
    cfg = layout_config(
        tp=tp,
        pp=pp,
        micro_batches=micro_batches,
        global_batch=global_batch,
        group_size=group_size,
        steps=steps,
        world_size=dist.get_world_size(),
        mini_batches=mini_batches,
        overrides=overrides,
    )
    trainer, arch = tiny_trainer(cfg, seed=seed, hf_dir=hf_dir)
    try:
        initial = param_checksum(trainer.model)
        losses, norms, skipped, metrics = [], [], [], []
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
            for result in train_step(trainer, batch):
                losses.append(result.loss)
                norms.append(result.grad_norm)
                skipped.append(result.skipped)
                metrics.append(result.metrics)
        return {
            "loss": losses,
            "grad_norm": norms,
            "param_checksum": param_checksum(trainer.model),
            "initial_checksum": initial,
            "skipped": skipped,
            "metrics": metrics,
            "layout": {**parallel.layout(), "micro_batches": micro_batches},
        }
    finally:
        parallel.destroy()
