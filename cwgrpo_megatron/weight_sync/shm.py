"""A shared-memory weight buffer: the trainer's ranks write their shards, the engine reads.

When the engine runs in its own processes, tensors must cross a process boundary. Gathering the
shards on rank 0 (an all-gather over TP, a broadcast over PP) and writing them there costs two
extra passes over the model. Instead the engine owns one file in shared memory (`/dev/shm`)
laid out as the full HF model:

    file   [ tensor 0 | tensor 1 | ... ]   each tensor contiguous, in `dtype`, 64-byte aligned
                                          (q|k|v_proj and gate|up_proj back to back)

and every rank of the model-parallel group copies its own shards straight into their slices of
the HF tensors (`convert.mapping.shard_pieces`): a QKV shard lands in rows of q/k/v_proj, a
row-parallel shard in columns of o_proj / down_proj, a vocabulary shard in rows of the embedding
without its padding. No rank sends a tensor to another; the engine process maps the same file
and loads views of it, so the model is copied once on each side.

The buffer is allocated once and reused by every sync (fresh tmpfs pages cost about 3x a copy
into touched ones): it holds one copy of the model in `dtype` in shared memory while the engine
lives. The folder is named after its owner's pid, so a run killed before its clean-up leaves
something `remove_orphaned_buffers` recognises.

No collectives here: the caller orders writes and reads (`weight_sync.senders`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from torch import Tensor

from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.convert.mapping import StageParam, shard_pieces
from cwgrpo_megatron.weight_sync.plan import Shard, SyncPlan

ALIGN = 64
_OWNED = re.compile(r"cwgrpo-buffer-(\d+)-")


@dataclass(frozen=True, kw_only=True)
class Entry:
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class SharedWeights:
    """The layout of a buffer file; small and picklable, so it can be sent to peers and to the
    engine processes. `token` lets a peer check that it sees the owner's file and not a file of
    the same name on another node."""

    path: str
    dtype: str
    entries: dict[str, Entry]
    nbytes: int
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def plan(cls, path: str, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        """Entries for `shapes` in their order, each aligned to `ALIGN` bytes, except that the
        members of a fused projection (`FUSED`: q/k/v_proj, gate/up_proj of one layer) follow
        each other without a gap, so that the engine reads the fused tensor as one view."""
        size = torch.empty((), dtype=dtype).element_size()
        entries, offset = {}, 0
        for name in shapes:
            if name in entries:
                continue
            for member in fused_members(name, shapes):
                entries[member] = Entry(offset=offset, shape=tuple(shapes[member]))
                offset += _numel(shapes[member]) * size
            offset = -(-offset // ALIGN) * ALIGN
        return cls(
            path=path, dtype=str(dtype).removeprefix("torch."), entries=entries, nbytes=offset
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def token_path(self) -> Path:
        return Path(self.path).with_name("owner")

    def visible(self) -> bool:
        """This process sees the owner's file (same node, same shared-memory folder)."""
        with contextlib.suppress(OSError):
            return self.token_path.read_text() == self.token
        return False

    def to_message(self) -> dict:
        """Plain types only: vLLM's RPC to engine processes does not carry dataclasses."""
        entries = [[name, e.offset, list(e.shape)] for name, e in self.entries.items()]
        fields = dict(path=self.path, dtype=self.dtype, nbytes=self.nbytes, token=self.token)
        return {**fields, "entries": entries}

    @classmethod
    def from_message(cls, message: dict) -> SharedWeights:
        entries = {n: Entry(offset=o, shape=tuple(s)) for n, o, s in message["entries"]}
        fields = {k: message[k] for k in ("path", "dtype", "nbytes", "token")}
        return cls(entries=entries, **fields)

    def _views(self) -> dict[str, Tensor]:
        flat = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        size = torch.empty((), dtype=self.torch_dtype).element_size()
        out = {}
        for name, entry in self.entries.items():
            nbytes = size * _numel(entry.shape)
            raw = flat[entry.offset : entry.offset + nbytes]
            out[name] = raw.view(self.torch_dtype).view(entry.shape)
        return out


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""The HF tensors vLLM's Qwen2 / Llama layers hold as one (its `packed_modules_mapping`)."""


def fused_members(name: str, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The HF names fused with `name` in the engine, in row order (`[name]` if none)."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    for members in FUSED.values():
        if proj in members:
            names = [f"{parent}.{m}.{leaf}" for m in members]
            if all(n in shapes for n in names):
                return names
    return [name]


def span(buffer: SharedWeights, names: list[str]) -> Tensor | None:
    """The tensors `names` stacked on dim 0, as one view of the buffer; None when they do not
    lie back to back (another layout) or their trailing shapes differ."""
    views = mapped(buffer)
    first, rows = views[names[0]], 0
    for name in names:
        view = views[name]
        if view.shape[1:] != first.shape[1:] or view.data_ptr() != first.data_ptr() + (
            rows * first[0].numel() * first.element_size()
        ):
            return None
        rows += view.shape[0]
    out = first.new_empty(0)
    return out.set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


_mapped: dict[str, dict[str, Tensor]] = {}


def mapped(buffer: SharedWeights) -> dict[str, Tensor]:
    """Every tensor of `buffer` as a view of its file (MAP_SHARED: writes reach the file and
    every process that maps it). Mapped once per process and kept: mapping anew each sync
    would fault every page in again. One buffer at a time: a new one unmaps the old."""
    if buffer.token not in _mapped:
        _mapped.clear()
        _mapped[buffer.token] = buffer._views()
    return _mapped[buffer.token]


def unmap(buffer: SharedWeights | None) -> None:
    if buffer is not None:
        _mapped.pop(buffer.token, None)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def create(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, *, folder: str) -> SharedWeights:
    """Allocate a buffer for `shapes` in a new folder under `folder`."""
    buffer = SharedWeights.plan("weights.bin", shapes, dtype)
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    if free < buffer.nbytes:
        raise RuntimeError(
            f"weight sync needs {buffer.nbytes / 2**30:.2f} GiB of shared memory in {folder}, "
            f"which has {free / 2**30:.2f} GiB free: enlarge it (docker: --shm-size) or set "
            "rollout.shm_dir to a bigger tmpfs"
        )
    root = Path(tempfile.mkdtemp(prefix=f"cwgrpo-buffer-{os.getpid()}-", dir=folder))
    buffer = dataclasses.replace(buffer, path=str(root / "weights.bin"))
    try:
        with open(buffer.path, "wb") as f:
            # reserve the pages now: a full tmpfs then fails here, not with SIGBUS mid-sync
            os.posix_fallocate(f.fileno(), 0, buffer.nbytes)
        buffer.token_path.write_text(buffer.token)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return buffer


def remove(buffer: SharedWeights | None) -> None:
    """Unmap the buffer here and delete its folder (other processes' mappings stay valid until
    they unmap; the memory is freed after the last)."""
    if buffer is not None:
        unmap(buffer)
        shutil.rmtree(Path(buffer.path).parent, ignore_errors=True)


def remove_orphaned_buffers(folder: str) -> int:
    """Delete buffers whose owner process is gone; returns how many."""
    removed = 0
    for path in Path(folder).glob("cwgrpo-buffer-*") if Path(folder).is_dir() else []:
        match = _OWNED.match(path.name)
        if match and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def fill(buffer: SharedWeights, tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy whole HF tensors into the buffer (a streamed update), cast to its dtype."""
    views = mapped(buffer)
    for name, tensor in tensors:
        views[name].copy_(tensor)


def write_shard(
    buffer: SharedWeights,
    item: StageParam,
    shard: Tensor,
    arch: ModelArch,
    *,
    tp: int,
    tp_rank: int,
) -> int:
    """Copy TP rank `tp_rank`'s shard of `item` into its slices of the buffer (cast to the
    buffer's dtype); returns the bytes written."""
    views, written = mapped(buffer), 0
    for index, where, values in shard_pieces(item.rule, shard, arch, tp=tp, tp_rank=tp_rank):
        target = views[item.hf_names[index]][where]
        target.copy_(values)
        written += target.numel() * target.element_size()
    return written


def write_shards(
    buffer: SharedWeights,
    params: dict[str, Tensor],
    arch: ModelArch,
    plan: SyncPlan,
    shard: Shard,
    *,
    te_spec: bool,
) -> int:
    """Copy this rank's Megatron parameters of `shard` (`plan.items`) into their slices of the
    buffer; returns bytes written.

    Over the shards of a plan every HF element is written exactly once: replicated parameters
    by TP rank 0, a tied output layer not at all (the first stage writes the embedding it
    copies), each expert by the expert-parallel rank that holds it.
    """
    tp = plan.tp_of(shard)
    return sum(
        write_shard(
            buffer, item, params[item.megatron_name].detach(), arch, tp=tp, tp_rank=shard.tp_rank
        )
        for item in plan.items(arch, shard, te_spec=te_spec)
    )
