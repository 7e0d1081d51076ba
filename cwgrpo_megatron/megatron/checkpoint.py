"""Megatron dist checkpoints (torch_dist) of the policy model, written atomically.

Layout of a checkpoint folder C:

    C/model/                   the dist checkpoint: loads at any TP x PP (Megatron reshards)
    C/cwgrpo_checkpoint.json   format version, the architecture, the layout it was saved at
    C/config.json, C/generation_config.json, tokenizer files   copied from the HF folder

A checkpoint is written into a hidden temporary sibling and renamed into place only when
complete, so an interrupted save leaves no partial C.

Megatron's torch_dist writer collects its results through the queue of a multiprocessing
Manager, started at the first save and kept for the process's life. Its server process waits
for a shutdown, which a SIGKILLed trainer never sends: each kill would leave one (about 270 MB)
per rank. `save_dist` hands Megatron the same kind of queue from a Manager whose server asks
the kernel to be killed with its parent (`_results_queue`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
from multiprocessing.managers import SyncManager
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel
from torch.distributed.checkpoint.api import CheckpointException

from cwgrpo_megatron.comm.collectives import barrier, job_rank, world_group
from cwgrpo_megatron.common.processes import die_with_parent
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.megatron.cpu import on_cpu
from cwgrpo_megatron.megatron.model import unwrap
from cwgrpo_megatron.megatron.parallel import layout

META_NAME = "cwgrpo_checkpoint.json"
MODEL_DIR = "model"
TRAIN_STATE_NAME = "train_state.json"
"""What a training checkpoint (`train_checkpoint.py`) holds beside the model and optimizer."""
FORMAT_VERSION = 1
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def copy_hf_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the config, generation config and tokenizer files that exist in `src`."""
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


class AtomicDir:
    """A temporary sibling folder that becomes `final` on `commit()` and vanishes otherwise.

    Collective: rank 0 creates, renames and cleans up; every rank waits at the barriers.
    """

    def __init__(self, final: str | os.PathLike, *, overwrite: bool = False) -> None:
        self.final = Path(final).resolve()
        self.tmp = self.final.parent / f".{self.final.name}.partial"
        self.overwrite = overwrite

    def __enter__(self) -> Path:
        if self.final.exists() and any(self.final.iterdir()) and not self.overwrite:
            raise ValueError(f"{self.final} already exists and is not empty; choose a new path")
        if job_rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir(parents=True)
        barrier(world_group())
        return self.tmp

    def commit(self) -> None:
        barrier(world_group())
        if job_rank() == 0:
            if self.final.exists():
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
        barrier(world_group())

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and job_rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)


def save_dist(sharded_state: dict, path: Path) -> None:
    """`dist_checkpointing.save` into the new folder `path` (collective; rank 0 creates it)."""
    if job_rank() == 0:
        path.mkdir()
    barrier(world_group())
    _results_queue()
    with on_cpu():
        dist_checkpointing.save(sharded_state, str(path))


_MANAGER: SyncManager | None = None


def _results_queue() -> None:
    """Give Megatron's async filesystem writer its results queue (once per process) from a
    Manager that dies with this process, before Megatron makes its own. Its server is spawned
    and imports only `common.processes` (it starts in 0.06 s; importing this module's Megatron
    there took 2.9 s, in every rank of every run)."""
    global _MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    _MANAGER = SyncManager(ctx=mp.get_context("spawn"))
    _MANAGER.start(initializer=die_with_parent)
    filesystem_async._results_queue = _MANAGER.Queue()


def load_dist(sharded_state: dict, path: Path) -> dict:
    """`dist_checkpointing.load` from `path`, any failure as a ValueError naming the folder."""
    try:
        with on_cpu():
            return dist_checkpointing.load(sharded_state, str(path))
    # megatron raises several types for unreadable or mismatched files; torch's
    # CheckpointException derives from BaseException, not Exception
    except (Exception, CheckpointException) as err:
        raise ValueError(
            f"cannot load the dist checkpoint in {path}: {type(err).__name__}: {err}"
        ) from err


def save_model(
    model: GPTModel,
    arch: ModelArch,
    ckpt_dir: str | os.PathLike,
    *,
    hf_dir: str | os.PathLike | None = None,
    params_dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Save this rank's stage into the dist checkpoint `ckpt_dir` (collective over all ranks)."""
    atomic = AtomicDir(ckpt_dir, overwrite=overwrite)
    with atomic as tmp:
        save_dist(model.sharded_state_dict(), tmp / MODEL_DIR)
        if job_rank() == 0:
            write_meta(tmp, model, arch, params_dtype=params_dtype, side_files_from=hf_dir)
        atomic.commit()
    return atomic.final


def write_meta(
    folder: Path,
    model,
    arch: ModelArch,
    *,
    params_dtype: str,
    side_files_from: str | os.PathLike | None,
) -> None:
    """What makes `folder` (its dist checkpoint in `folder/model`) a checkpoint that the
    converter and `model.path` read: META_NAME, and the HF config and tokenizer files of
    `side_files_from` (the HF folder the model came from). Rank 0 only."""
    meta = {
        "format_version": FORMAT_VERSION,
        "arch": arch.to_dict(),
        "saved_layout": layout(),
        "padded_vocab_size": unwrap(model).vocab_size,
        "params_dtype": params_dtype,
    }
    (folder / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    if side_files_from is not None:
        copy_hf_side_files(side_files_from, folder)


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / META_NAME
    if not Path(ckpt_dir).is_dir():
        raise ValueError(f"checkpoint folder {ckpt_dir} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is missing: {ckpt_dir} is not a cwgrpo_megatron checkpoint")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is corrupt ({err})") from err
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}"
        )
    return meta


def checkpoint_arch(ckpt_dir: str | os.PathLike) -> ModelArch:
    return ModelArch(**read_meta(ckpt_dir)["arch"])


def load_model(model: GPTModel, arch: ModelArch, ckpt_dir: str | os.PathLike) -> None:
    """Load the dist checkpoint into this rank's stage, resharding from the saved layout."""
    saved = checkpoint_arch(ckpt_dir)
    if saved != arch:
        diff = {
            k: (v, getattr(arch, k)) for k, v in saved.to_dict().items() if getattr(arch, k) != v
        }
        raise ValueError(
            f"checkpoint {ckpt_dir} was saved for another architecture; (saved, requested): {diff}"
        )
    if (Path(ckpt_dir) / TRAIN_STATE_NAME).is_file():
        # a training checkpoint holds {"model", "optimizer"}: ask for the model alone (the
        # optimizer's common state comes back beside it, and is dropped)
        state = load_dist({"model": model.sharded_state_dict()}, Path(ckpt_dir) / MODEL_DIR)
        state = state["model"]
    else:
        state = load_dist(model.sharded_state_dict(), Path(ckpt_dir) / MODEL_DIR)
    model.load_state_dict(state, strict=True)
