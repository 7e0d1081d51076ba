"""HF safetensors <-> Megatron dist checkpoints, and a numerical check between the two.

Both directions stream: HF tensors are read one at a time into the Megatron model, and HF
shards are flushed as they fill, so peak memory stays near one copy of the model.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cwgrpo_megatron.comm import job_rank, vocab_parallel_logprob_entropy
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.convert.mapping import hf_names, stage_params, to_hf
from cwgrpo_megatron.convert.safetensors_io import HFCheckpoint, write_sharded
from cwgrpo_megatron.megatron import parallel, train_checkpoint
from cwgrpo_megatron.megatron.checkpoint import (
    META_NAME,
    MODEL_DIR,
    AtomicDir,
    checkpoint_arch,
    copy_hf_side_files,
    load_model,
    read_meta,
    save_model,
)
from cwgrpo_megatron.megatron.forward import forward_logits
from cwgrpo_megatron.megatron.launch import init_distributed
from cwgrpo_megatron.megatron.model import (
    DTYPES,
    build_model,
    load_hf_weights,
    use_transformer_engine,
)

log = logging.getLogger(__name__)
VOCAB_DIVISIBLE_BY = 128


def _dtype_name(requested: str | None, arch: ModelArch) -> str:
    name = requested or (arch.torch_dtype if arch.torch_dtype in DTYPES else "float32")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of: {', '.join(DTYPES)}")
    return name


def _start(tp: int, pp: int, ep: int = 1, expert_tp: int = 1) -> None:
    """One process builds the whole model; under torchrun the world must be exactly
    pp x lcm(tp, ep x expert_tp) ranks (tp x pp for a dense model)."""
    init_distributed()
    world = dist.get_world_size()
    ranks = pp * math.lcm(tp, ep * expert_tp)
    if world == 1:
        parallel.initialize(tp=1, pp=1)
    elif world == ranks:
        parallel.initialize(tp=tp, pp=pp, ep=ep, expert_tp=expert_tp)
    else:
        raise ValueError(
            f"run in one process, or under torchrun with pp x lcm(tp, ep x expert_tp) = {ranks} "
            "ranks"
        )


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    expert_tp: int = 1,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert an HF Qwen2 / Qwen3 / Qwen3-MoE / Llama folder into a Megatron dist checkpoint
    at `out`.

    The checkpoint loads at any layout (Megatron reshards on load, experts included). The
    layout is checked against the model and `tp` sets the vocabulary padding (a multiple of
    128 x tp); under torchrun (`_start` says how many ranks) each rank builds and writes its
    own shard, its experts only.
    """
    arch = ModelArch.from_hf_dir(hf_dir)
    arch.check_layout(tp=tp, pp=pp, ep=ep, expert_tp=expert_tp)
    ckpt = HFCheckpoint(hf_dir)
    missing = [n for n in hf_names(arch) if n not in ckpt]
    if missing:
        raise ValueError(f"{hf_dir}: tensors missing for {arch.architecture}: {missing[:5]}")
    dtype_name = _dtype_name(dtype, arch)
    _start(tp, pp, ep, expert_tp)
    try:
        single = dist.get_world_size() == 1
        model = build_model(
            arch,
            params_dtype=DTYPES[dtype_name],
            make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY * (tp if single else 1),
            perform_initialization=False,
        )
        load_hf_weights(model, arch, ckpt.get)
        return save_model(
            model, arch, out, hf_dir=hf_dir, params_dtype=dtype_name, overwrite=overwrite
        )
    finally:
        parallel.destroy()


def load_checkpoint_model(ckpt_dir: str | os.PathLike):
    """(model, arch, meta) of a checkpoint, at the current parallel layout."""
    meta = read_meta(ckpt_dir)
    arch = ModelArch(**meta["arch"])
    model = build_model(
        arch, params_dtype=DTYPES[meta["params_dtype"]], perform_initialization=False
    )
    load_model(model, arch, ckpt_dir)
    return model.eval(), arch, meta


def _hf_tensors(model, arch: ModelArch, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in `dtype` (the checkpoint's parameters are already in it: a no-op
    unless the two differ)."""
    params = dict(model.named_parameters())
    for item in stage_params(arch, pp=1, te_spec=use_transformer_engine()):
        tensors = to_hf(item.rule, [params[item.megatron_name].detach()], arch)
        for name, tensor in zip(item.hf_names, tensors, strict=True):
            yield name, tensor.to(dtype)


def megatron_to_hf(
    ckpt_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a checkpoint saved at any TP x PP as sharded HF safetensors (one process).
    `ckpt_dir` is what `find_checkpoint` takes: a converted checkpoint or a run's training one.

    Shards hold at most `max_shard_bytes` (default: 2 GiB, or an eighth of the model if that is
    less): serialising a shard copies it, so the shard size bounds the memory above the model.
    """
    ckpt_dir = find_checkpoint(ckpt_dir)  # fail on a bad folder before starting anything
    _start(1, 1)
    try:
        model, arch, meta = load_checkpoint_model(ckpt_dir)
        dtype = DTYPES[meta["params_dtype"]]
        atomic = AtomicDir(out, overwrite=overwrite)
        with atomic as tmp:
            if max_shard_bytes is None:
                model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
                max_shard_bytes = max(1 << 20, min(2 << 30, model_bytes // 8))
            write_sharded(_hf_tensors(model, arch, dtype), tmp, max_shard_bytes=max_shard_bytes)
            copy_hf_side_files(ckpt_dir, tmp)
            atomic.commit()
        return atomic.final
    finally:
        parallel.destroy()


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The model checkpoint that `path` names: a checkpoint folder (converted, or a run's
    `checkpoints/step_N`), a training checkpoint's `model/` folder, or a run folder (its newest
    checkpoint). ValueError saying which of these to give otherwise."""
    path = Path(path)
    if path.name == MODEL_DIR and is_megatron_checkpoint(path.parent):
        return path.parent
    if (path / "checkpoints").is_dir() and not is_megatron_checkpoint(path):
        newest = train_checkpoint.latest(path / "checkpoints")
        if newest is None:
            raise ValueError(f"the run folder {path} has no checkpoint in {path / 'checkpoints'}")
        path = newest
    if path.is_dir() and not is_megatron_checkpoint(path):
        raise ValueError(
            f"{path} holds no {META_NAME}: give a checkpoint written by "
            "tools/convert_hf_to_megatron.py, a run's checkpoints/step_N, or the run folder"
        )
    read_meta(path)  # a missing folder, or a corrupt or foreign description, fails here
    return path


def is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / META_NAME).is_file()


def start_arch(path: str | os.PathLike, *, recipe: str | None = None) -> ModelArch:
    """The architecture of a start checkpoint: an HF folder or a Megatron checkpoint. With
    `recipe` (model.arch), ValueError unless it is that model's architecture."""
    if not str(path) or not Path(path).is_dir():
        raise ValueError(
            f"model.path={str(path)!r} is not a folder: point it at an HF Qwen2 / Llama "
            "checkpoint, or at a Megatron checkpoint written by tools/convert_hf_to_megatron.py"
        )
    arch = checkpoint_arch(path) if is_megatron_checkpoint(path) else ModelArch.from_hf_dir(path)
    if recipe is not None:
        differences = ModelArch.recipe(recipe).differences(arch)
        if differences:
            raise ValueError(
                f"model.path={str(path)!r} is not the model.arch={recipe!r} this config was "
                f"written for (recipe vs checkpoint): {'; '.join(differences)}. Point model.path "
                "at that model, or set model.arch to the checkpoint's model (or null)"
            )
    return arch


def load_start_weights(model, arch: ModelArch, path: str | os.PathLike) -> None:
    """Load a start checkpoint into this rank's stage at the current layout: a Megatron
    checkpoint through dist-checkpointing (resharded), an HF folder tensor by tensor (each rank
    reads the tensors of its own pipeline stage and keeps its TP shard)."""
    if is_megatron_checkpoint(path):
        load_model(model, arch, path)
    else:
        load_hf_weights(model, arch, HFCheckpoint(path).get)


def export_hf(
    model,
    arch: ModelArch,
    out: str | os.PathLike,
    *,
    side_files_from: str | os.PathLike,
    dtype: str,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write the model as an HF checkpoint at `out` (replaced atomically), loadable by
    transformers and vLLM; config and tokenizer files come from `side_files_from`.

    Collective over every rank. The model-parallel group of data-parallel rank 0 streams the
    full HF tensors (PP broadcast, TP all-gather: `weight_sync.hf_weights`); rank 0 writes
    them shard by shard, so it holds one shard beyond the model.
    """
    from cwgrpo_megatron.megatron.publish import hf_weights, in_engine_group

    atomic = AtomicDir(out, overwrite=True)
    with atomic as tmp:
        if in_engine_group():
            stream = hf_weights(model, arch, dtype=dtype)
            if job_rank() == 0:
                write_sharded(stream, tmp, max_shard_bytes=max_shard_bytes)
                copy_hf_side_files(side_files_from, tmp)
                _set_config_dtype(tmp / "config.json", dtype)
            else:
                for _ in stream:  # the collectives need every peer of the group
                    pass
        atomic.commit()
    return atomic.final


def _set_config_dtype(path: Path, dtype: str) -> None:
    """config.json states the dtype of the tensors beside it (transformers loads "auto")."""
    config = json.loads(path.read_text())
    config["torch_dtype"] = dtype
    if "dtype" in config:  # the key transformers 5 writes
        config["dtype"] = dtype
    path.write_text(json.dumps(config, indent=2) + "\n")


def compare_with_hf(
    hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, *, batch: int = 4, seq: int = 32
) -> dict[str, float]:
    """Max |delta logits| and max |delta log-prob| of the two models on fixed token sequences."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    _start(1, 1)
    try:
        model, arch, _ = load_checkpoint_model(ckpt_dir)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=gen)
        logits = forward_logits(model, tokens).float()[..., : arch.vocab_size]
        with torch.no_grad():
            ref = hf(tokens).logits.float().to(logits.device)  # HF's model stays on the host
        target = torch.roll(tokens, -1, dims=1).to(logits.device)
        logp, _ = vocab_parallel_logprob_entropy(
            logits, target, group=parallel_state.get_tensor_model_parallel_group()
        )
        ref_logp = torch.log_softmax(ref, -1).gather(-1, target[..., None]).squeeze(-1)
        return {
            "max_abs_logits": (logits - ref).abs().max().item(),
            "max_abs_logprob": (logp - ref_logp).abs().max().item(),
        }
    finally:
        parallel.destroy()
