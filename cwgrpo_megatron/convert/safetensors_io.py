"""Read and write Hugging Face safetensors checkpoints, one tensor at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpoint:
    """Lazy access to the tensors of an HF folder (one `model.safetensors` or a sharded index).

    Tensors are read on demand, so a converter holds one at a time besides what it builds.
    """

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"{index} is not a valid safetensors index ({err})") from err
            self._file_of = {name: self.dir / f for name, f in weight_map.items()}
        elif (self.dir / SINGLE_NAME).is_file():
            path = self.dir / SINGLE_NAME
            with self._open(path) as f:
                self._file_of = {name: path for name in f.keys()}  # noqa: SIM118
        else:
            raise ValueError(
                f"{self.dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}: not an HF checkpoint"
            )
        missing = sorted({str(p) for p in self._file_of.values() if not p.is_file()})
        if missing:
            raise ValueError(f"{self.dir}: shard files listed in the index are missing: {missing}")

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path} is not a readable safetensors file ({err})") from err

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise ValueError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        path = self._file_of[name]
        try:
            with self._open(path) as f:
                return f.get_tensor(name)
        except SafetensorError as err:
            raise ValueError(f"{path}: tensor {name!r} cannot be read ({err})") from err


def write_sharded(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 2 << 30,
) -> None:
    """Write (name, tensor) pairs as sharded safetensors plus `model.safetensors.index.json`.

    Shards are flushed as they fill, so at most one shard is held in memory.
    """
    out = Path(out_dir)
    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    total = 0
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            name = f"part-{len(shards):05d}.safetensors"
            save_file(pending, str(out / name), metadata={"format": "pt"})
            shards.append(list(pending))
            pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor.contiguous()
        pending_bytes += size
        total += size
    flush()
    count = len(shards)
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(out / f"part-{i:05d}.safetensors", out / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def iter_tensors(ckpt: HFCheckpoint, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        yield name, ckpt.get(name)
