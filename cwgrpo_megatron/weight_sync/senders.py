"""The trainer's side of each weight path (`weight_sync.names`), resolved once, when the run is
built, into a sender with one `send(model, engine)`:

    sender = build_sender(plan, engine, export, group=world, control=control)  # every rank, once
    result = sender.send(model, engine)                        # every rank, every sync

`build_sender` asks each replica's owner how its engine takes weights (its `sync_path`, and
its shm buffer where it takes shm) in one all_gather_object, so that every rank builds the
same sender; an engine on ipc or nccl takes shm instead when a shard has to cross nodes
(`plan.transfers`), where the buffers move it once per node rather than once per GPU.

    ShmSender       the writers of each node copy their shards into the node's buffers, the
                    shards the node lacks cross the network (`fill_buffers`), a barrier, then
                    each owner's engine loads its buffer
    TransferSender  every rank exports the whole model on its GPU; vLLM's weight transfer
                    hands it over CUDA IPC (`ipc`) or each owner broadcasts it over NCCL
                    (`nccl`)
    StreamSender    data-parallel rank 0's model-parallel group streams full tensors to the
                    one engine, on rank 0

What a sender reads of the model is a `ModelExport` (`megatron.publish.MegatronExport`, the
Megatron side). Control traffic per sync: one all_gather_object over `group` of the loads'
outcomes and the bytes each rank received, so that every rank learns of a failed load on any
replica; the shm path adds a barrier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from cwgrpo_megatron.comm import all_gather_or_fail, exchange, fail_together, rank_in
from cwgrpo_megatron.comm.collectives import Group, barrier
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.convert.mapping import hf_shapes
from cwgrpo_megatron.weight_sync.export import export_names
from cwgrpo_megatron.weight_sync.names import TRANSFER_PATHS
from cwgrpo_megatron.weight_sync.plan import SyncPlan, shard_shape
from cwgrpo_megatron.weight_sync.receiver import WeightReceiver
from cwgrpo_megatron.weight_sync.shm import SharedWeights, write_shard, write_shards

if TYPE_CHECKING:
    from cwgrpo_megatron.weight_sync.transfer import HFSource

BUFFER_BYTES = 1 << 30
"""The least size of each packed buffer of vLLM's transfer, IPC's one and NCCL's two (vLLM's
default); a buffer grows to the largest tensor."""
TRANSFER_BUCKET_BYTES = 256 << 20
"""Shards in flight at once between nodes: bounds the copies a sender casts to the engine dtype
and the tensors a receiver holds before writing them."""


class ModelExport(Protocol):
    """What a sender reads of the trainer's model (`megatron.publish.MegatronExport`)."""

    arch: ModelArch
    dtype: torch.dtype
    """The engines' dtype, which every tensor is cast to."""
    te_spec: bool
    """The model was built with Transformer Engine's layer spec (its fused names)."""
    pp: int
    ep: int
    """Expert-parallel size: a MoE model's experts stream from every EP rank."""
    in_engine_group: bool
    """This rank takes part in the stream (data-parallel rank 0's model-parallel group, and
    the expert-parallel peers that hold its experts)."""

    def shards(self, model) -> dict[str, Tensor]:
        """This rank's parameters by Megatron name."""
        ...

    def full_tensors(self, model) -> Iterator[tuple[str, Tensor]]:
        """The whole model as HF-named full tensors in `dtype`: a collective over this rank's
        model-parallel group (PP broadcast, TP all-gather)."""
        ...


@dataclass(frozen=True)
class SyncResult:
    version: int | None
    """This rank's engine's policy version after the sync; None on ranks without an engine."""
    path: str
    """The weight path (`weight_sync.names`)."""
    received: dict[int, int]
    """Bytes each node with an engine received from other nodes in this sync, measured."""


class Sender(Protocol):
    path: str

    def send(self, model, engine: WeightReceiver | None) -> SyncResult:
        """The model into every replica's engine (`engine` on the owners, None elsewhere);
        every rank calls it."""
        ...


@dataclass(frozen=True)
class Offer:
    """How an owner's engine takes weights for this plan."""

    path: str
    buffer: SharedWeights | None = None
    """The engine's buffer, on the shm path."""


@dataclass(kw_only=True)
class _Loads:
    """What every sender shares: the plan, the export, the group, and the agreement on the
    loads' outcome."""

    plan: SyncPlan
    export: ModelExport
    group: Group
    """The world: the shm path's barrier."""
    control: Group
    """The job's control group (`comm.open_control_group`): the agreements."""
    rank: int

    def _loaded(self, load: Callable[[], int], engine: WeightReceiver | None) -> SyncResult:
        """Run `load` (the bytes this rank received) on every rank, agree on its outcome, and
        sum the bytes received by node."""
        outcomes = all_gather_or_fail(
            load, "loading the weights into the rollout engines", self.control
        )
        replicas = self.plan.replicas
        by_node = {replicas.nodes[o]: 0 for o in replicas.owners}
        for member, nbytes in enumerate(outcomes):
            if nbytes:
                by_node[replicas.nodes[member]] += nbytes
        version = None if engine is None else engine.version
        return SyncResult(version=version, path=self.path, received=by_node)


@dataclass(kw_only=True)
class ShmSender(_Loads):
    mine: list[SharedWeights]
    """The buffers of this rank's node's engines."""
    path: str = "shm"

    def send(self, model, engine: WeightReceiver | None) -> SyncResult:
        export = self.export
        received = fill_buffers(
            export.shards(model),
            export.arch,
            self.plan,
            self.mine,
            dtype=export.dtype,
            rank=self.rank,
            te_spec=export.te_spec,
        )
        barrier(self.group)  # every shard is in before an engine reads

        def load() -> int:
            if engine is not None:
                engine.load_shm()
            return received

        return self._loaded(load, engine)


@dataclass(kw_only=True)
class TransferSender(_Loads):
    path: str
    """ipc or nccl."""
    transfer: Callable
    """`weight_sync.ipc.send_ipc` or `weight_sync.nccl.send_nccl`."""

    def send(self, model, engine: WeightReceiver | None) -> SyncResult:
        source = _transfer_source(model, self.export)

        def load() -> int:
            if engine is None:
                self.transfer(source)
            else:
                engine.load_transfer(lambda llm: self.transfer(source, llm))
            return 0

        return self._loaded(load, engine)


@dataclass(kw_only=True)
class StreamSender(_Loads):
    path: str = "stream"

    def send(self, model, engine: WeightReceiver | None) -> SyncResult:
        def load() -> int:
            if not self.export.in_engine_group:
                return 0
            stream = self.export.full_tensors(model)
            if engine is None:
                for _ in stream:  # the collectives need every peer; the tensors are not needed
                    pass
            else:
                engine.load_stream(stream)
            return 0

        return self._loaded(load, engine)


def build_sender(
    plan: SyncPlan,
    engine: WeightReceiver | None,
    export: ModelExport,
    *,
    group: Group,
    control: Group,
) -> Sender:
    """The sender of this job's weight path; every rank of `group` (the world) calls it, the
    replica owners with their engine; its agreements go over `control` (the job's control
    group, or the world). ValueError on every rank when an owner's engine holds another
    model, cannot make its buffer, or the engines take different paths, and when a rank
    cannot see its node's buffers.

    Communication: one all_gather_object over `control` (the owners' offers); on the shm
    path one more, of whether each rank sees its node's buffers."""
    rank, replicas = rank_in(group), plan.replicas
    if (engine is not None) != (replicas.owned_by(rank) is not None):
        raise ValueError(
            f"the rollout engines must be held by the replica owners {replicas.owners}"
        )
    offers = all_gather_or_fail(
        lambda: _offer(engine, export, direct=not plan.transfers),
        "preparing the weight sync",
        control,
    )
    owned = [offers[o] for o in replicas.owners]
    paths = sorted({o.path for o in owned})
    if len(paths) > 1:
        raise ValueError(
            f"the rollout engines take their weights in different ways ({', '.join(paths)}): "
            "set rollout.weight_sync and rollout.placement alike on every node"
        )
    common = dict(plan=plan, export=export, group=group, control=control, rank=rank)
    path = paths[0]
    if path == "shm":
        mine = [offers[o].buffer for o in replicas.owners_on(replicas.nodes[rank])]
        with fail_together("reaching the engines' weight buffers", control):
            for buffer in mine:
                if not buffer.visible():
                    raise ValueError(
                        f"this rank cannot see the weight buffer {buffer.path} of an engine on "
                        "its node: the ranks of a node must share rollout.shm_dir (docker: "
                        "--ipc=host)"
                    )
        return ShmSender(**common, mine=mine)
    if path in TRANSFER_PATHS:
        return TransferSender(**common, path=path, transfer=_transfer_function(path))
    if len(owned) > 1:
        raise ValueError(
            f"{len(owned)} engine replicas need engines with a shared weight buffer "
            "(rollout.backend=vllm in engine processes): set rollout.replicas=1"
        )
    return StreamSender(**common)


def check_engine(engine: WeightReceiver, arch: ModelArch) -> None:
    """ValueError when `engine` holds another model than the trainer's `arch`."""
    if engine.shapes != hf_shapes(arch):
        raise ValueError(
            f"the rollout engine started from {engine.model_dir} has other tensor names or "
            "shapes than the trainer's model: start every engine from the checkpoint the "
            "trainer was built from (model.path must hold the same model on every node)"
        )


def _offer(engine: WeightReceiver | None, export: ModelExport, *, direct: bool) -> Offer | None:
    """An owner's offer (None on other ranks): its engine's path, or shm with the engine's
    buffer where that path is ipc or nccl but a shard crosses nodes (`direct` False)."""
    if engine is None:
        return None
    check_engine(engine, export.arch)
    path = engine.sync_path
    if path == "stream" or (path in TRANSFER_PATHS and direct):
        return Offer(path)
    try:
        return Offer("shm", engine.shm_buffer(export.dtype))
    except (OSError, RuntimeError) as err:  # e.g. too little shared memory
        raise ValueError(f"the rollout engine's weight buffer could not be made: {err}") from err


def _transfer_function(path: str) -> Callable:
    """The sender of vLLM's transfer on `path` (imported now: vLLM's transfer engines)."""
    if path == "ipc":
        from cwgrpo_megatron.weight_sync.ipc import send_ipc

        return send_ipc
    from cwgrpo_megatron.weight_sync.nccl import send_nccl

    return send_nccl


def _transfer_source(model, export: ModelExport) -> HFSource:
    """The model as vLLM's weight transfer reads it: a fresh `full_tensors` pass per
    iteration, with every tensor's name, dtype and shape in export order."""
    from cwgrpo_megatron.weight_sync.transfer import HFSource

    shapes = hf_shapes(export.arch)
    names = export_names(export.arch, pp=export.pp, ep=export.ep, te_spec=export.te_spec)
    return HFSource(
        lambda: export.full_tensors(model),
        [(name, export.dtype, shapes[name]) for name in names],
    )


def fill_buffers(
    params: dict[str, Tensor],
    arch: ModelArch,
    plan: SyncPlan,
    buffers: list[SharedWeights],
    *,
    dtype: torch.dtype,
    rank: int,
    te_spec: bool,
) -> int:
    """Rank `rank`'s part of `plan`, from its parameters `params` (by Megatron name): its own
    shard into `buffers` (its node's engines) when it is its node's writer of that shard, and
    the shards it sends to, or receives from, other nodes (received ones are written into
    `buffers`). Returns the bytes this rank received.

    Every rank walks the same list of cross-node messages (one per parameter of each transfer)
    in buckets of `TRANSFER_BUCKET_BYTES`: it posts the sends and receives of a bucket that
    are its own, waits for them, writes what it received, and moves on; the tag of a message
    is its index in the bucket. Point to point over the world; nothing when a node holds every
    shard."""
    for writer, shard in plan.writes:
        if writer == rank:
            for buffer in buffers:
                write_shards(buffer, params, arch, plan, shard, te_spec=te_spec)
    messages = [
        (t, item) for t in plan.transfers for item in plan.items(arch, t.shard, te_spec=te_spec)
    ]
    device = next(iter(params.values())).device
    size = torch.empty((), dtype=dtype).element_size()
    received, start = 0, 0
    while start < len(messages):
        bucket, nbytes = [], 0
        while start < len(messages) and (not bucket or nbytes < TRANSFER_BUCKET_BYTES):
            t, item = messages[start]
            shape = shard_shape(item, arch, tp=plan.tp_of(t.shard))
            bucket.append((t, item, shape))
            nbytes += torch.Size(shape).numel() * size
            start += 1
        sends, recvs, landed = [], [], []
        for tag, (t, item, shape) in enumerate(bucket):
            if t.src == rank:
                shard = params[item.megatron_name].detach().to(dtype).contiguous()
                sends.append((shard, t.dst, tag))
            if t.dst == rank:
                shard = torch.empty(shape, dtype=dtype, device=device)
                recvs.append((shard, t.src, tag))
                landed.append((t, item, shard))
        exchange(sends, recvs)
        for t, item, shard in landed:
            received += shard.numel() * shard.element_size()
            for buffer in buffers:
                write_shard(
                    buffer, item, shard, arch, tp=plan.tp_of(t.shard), tp_rank=t.shard.tp_rank
                )
    return received
