"""The Megatron side of the weight sync: this rank's shards published into the rollout
engines, and the log-prob check. (The `weight_sync` package holds what does not touch Megatron:
the plan, the shared-memory buffers and the HF export of a shard.)

One engine per replica (`rollout.replicas.Replicas`), owned by the first rank of its group;
with one replica that is global rank 0 (`ENGINE_RANK`). Per sync, every engine gets the whole
model: the ranks of its node write their shards into its shared-memory buffer, and shards that
no rank of the node holds (pipeline stages or TP ranks on other nodes) cross the network once
per node (`weight_sync.plan.SyncPlan`). On GPUs (`rollout.weight_sync`), when no shard has to
cross nodes, vLLM engines take their weights through vLLM's own transfer instead: every rank
exports the whole model on its own GPU, and vLLM hands it over CUDA IPC to the engine on the
same GPU (`weight_sync.ipc`), or the engine's owner broadcasts it over NCCL to an engine on
GPUs of its own (`weight_sync.nccl`, rollout.placement=separate). An engine without a buffer
(the torch backend, or vLLM in-process on a GPU) takes the streamed export, which supports one
replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cwgrpo_megatron.comm import (
    all_gather_objects,
    all_gather_or_fail,
    broadcast_from,
    exchange,
    fail_together,
    size_of,
    vocab_parallel_logprob_entropy,
    world_group,
)
from cwgrpo_megatron.comm.collectives import barrier
from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.convert.mapping import hf_shapes
from cwgrpo_megatron.megatron.forward import forward_logits
from cwgrpo_megatron.megatron.model import DTYPES, unwrap, use_transformer_engine
from cwgrpo_megatron.rollout.replicas import Replicas
from cwgrpo_megatron.weight_sync.export import ExportGroups, export_names, hf_tensors
from cwgrpo_megatron.weight_sync.plan import Place, SyncPlan, sent_items, shard_shape
from cwgrpo_megatron.weight_sync.receiver import WeightReceiver
from cwgrpo_megatron.weight_sync.shm import SharedWeights, write_shard, write_shards

ENGINE_RANK = 0


def export_groups() -> ExportGroups:
    tp, pp = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    return ExportGroups(
        tp=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        pp=parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None,
        te_spec=use_transformer_engine(),
    )


def hf_weights(model, arch: ModelArch, *, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model as HF-named full tensors in `dtype`; a collective over TP x PP."""
    params = dict(unwrap(model).named_parameters())
    device = next(iter(params.values())).device
    return hf_tensors(params, arch, groups=export_groups(), dtype=DTYPES[dtype], device=device)


def in_engine_group() -> bool:
    """This rank takes part in the export to the engine (it shares rank 0's model copy)."""
    return parallel_state.get_data_parallel_rank() == 0


@dataclass(frozen=True)
class SyncResult:
    version: int | None
    """This rank's engine's policy version after the sync; None on ranks without an engine."""
    path: str
    """How the weights went: "shared" (shards written into the engines' buffers, and sent
    across nodes where a node lacks them), "ipc" (every rank's export on its GPU, over CUDA
    IPC), "nccl" (each owner's export, broadcast to its engine's GPUs) or "stream" (the
    export's collectives, one engine)."""
    received: dict[int, int]
    """Bytes each node with an engine received from other nodes in this sync, measured."""


TRANSFER_BUCKET_BYTES = 256 << 20
"""Shards in flight at once between nodes: bounds the copies a sender casts to the engine dtype
and the tensors a receiver holds before writing them."""


def sync_plan(replicas: Replicas) -> SyncPlan:
    """The sync plan of this job's layout; one all_gather_object of every rank's shard."""
    here = Place(
        stage=parallel_state.get_pipeline_model_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
    )
    return SyncPlan.build(replicas, all_gather_objects(here, world_group()))


def check_engine(engine: WeightReceiver, arch: ModelArch) -> None:
    """ValueError when `engine` holds another model than the trainer's `arch`."""
    if engine.shapes != hf_shapes(arch):
        raise ValueError(
            f"the rollout engine started from {engine.model_dir} has other tensor names or "
            "shapes than the trainer's model: start every engine from the checkpoint the "
            "trainer was built from (model.path must hold the same model on every node)"
        )


def sync_weights(
    model,
    arch: ModelArch,
    engine: WeightReceiver | None,
    *,
    dtype: str,
    plan: SyncPlan | None = None,
) -> SyncResult:
    """Push the model into every replica's engine (`engine` on the owners, None elsewhere).
    Every rank calls this; `plan` None means one engine on rank 0 and one node (built here
    with one all-gather; pass `sync_plan`'s to reuse it). Returns a `SyncResult`.

    Buffered engines: each owner's buffer is offered to every rank; the writers of each node
    copy their shards into the node's buffers; shards the node lacks are sent to it
    (`fill_buffers`); a barrier; each owner's engine loads its buffer. Otherwise (one engine
    without a buffer) the export streams full tensors to rank 0 (PP broadcast, TP all-gather).

    Control traffic: two all_gather_objects over the world (the owners' offers, then the
    loads' outcomes and the bytes each rank received, so that every rank learns of a refusal
    or a failed load on any replica) and a barrier; once per set of buffers, one more to check
    that every rank sees its node's buffers.
    """
    world = world_group()
    rank = dist.get_rank() if world is not None else 0
    plan = plan or sync_plan(Replicas.single(size_of(world)))
    replicas = plan.replicas
    if (engine is not None) != (replicas.owned_by(rank) is not None):
        raise ValueError(
            f"the rollout engines must be held by the replica owners {replicas.owners}"
        )
    # vLLM's transfer (CUDA IPC or NCCL) when every shard is on every engine's node; else the
    # buffers, so that a shard a node lacks crosses the network once for the node, not once
    # for each of its GPUs
    direct = not plan.transfers
    offers = all_gather_or_fail(
        lambda: _offer(engine, arch, dtype, direct=direct), "preparing the weight sync", world
    )
    buffers = [offers[o] for o in replicas.owners]
    received = 0
    vllm_offers = [b for b in buffers if isinstance(b, str)]  # for vLLM's own transfer
    if len(vllm_offers) == len(buffers) and len(set(vllm_offers)) == 1:
        # chosen only when every engine's node holds every shard: the export's PP broadcasts
        # and TP all-gathers stay inside the node, and no node receives anything
        path, source = buffers[0], _transfer_source(model, arch, dtype)
        send = TRANSFERS[path]()

        def load():
            if engine is None:
                send(source)
            else:
                engine.receive(lambda llm: send(source, llm))
            return received

    elif vllm_offers:
        ways = sorted(
            {"stream" if b is None else b if isinstance(b, str) else "shm" for b in buffers}
        )
        raise ValueError(
            f"the rollout engines take their weights in different ways ({', '.join(ways)}): set "
            "rollout.weight_sync and rollout.placement alike on every node"
        )
    elif all(b is not None for b in buffers):
        path, node = "shared", replicas.nodes[rank]
        mine = [offers[o] for o in replicas.owners_on(node)]
        _check_visible(buffers, mine, world)
        received = fill_buffers(model, arch, plan, mine, dtype=DTYPES[dtype])
        barrier(world)  # every shard is in before an engine reads

        def load():
            if engine is not None:
                engine.load_shared_weights()
            return received

    elif len(buffers) == 1:
        path = "stream"

        def load():
            _stream(model, arch, engine, dtype)
            return received

    else:
        raise ValueError(
            f"{len(buffers)} engine replicas need engines with a shared weight buffer "
            "(rollout.backend=vllm in engine processes): set rollout.replicas=1"
        )
    outcomes = all_gather_or_fail(load, "loading the weights into the rollout engines", world)
    by_node = {replicas.nodes[o]: 0 for o in replicas.owners}
    for member, nbytes in enumerate(outcomes):
        if nbytes:
            by_node[replicas.nodes[member]] += nbytes
    return SyncResult(
        version=None if engine is None else engine.version, path=path, received=by_node
    )


def fill_buffers(
    model, arch: ModelArch, plan: SyncPlan, buffers: list[SharedWeights], *, dtype: torch.dtype
) -> int:
    """This rank's part of `plan`: its own shard into `buffers` (its node's engines) when it is
    its node's writer of that shard, and the shards it sends to, or receives from, other nodes
    (received ones are written into `buffers`). Returns the bytes this rank received.

    Every rank walks the same list of cross-node messages (one per parameter of each transfer)
    in buckets of `TRANSFER_BUCKET_BYTES`: it posts the sends and receives of a bucket that
    are its own, waits for them, writes what it received, and moves on; the tag of a message
    is its index in the bucket. Point to point over the world; nothing when a node holds every
    shard."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    here, te_spec = plan.places[rank], use_transformer_engine()
    params = dict(unwrap(model).named_parameters())
    if rank in plan.writers:
        for buffer in buffers:
            write_shards(
                buffer,
                params,
                arch,
                tp=plan.tp,
                tp_rank=here.tp_rank,
                pp=plan.pp,
                pp_rank=here.stage,
                te_spec=te_spec,
            )
    messages = [
        (t, item)
        for t in plan.transfers
        for item in sent_items(arch, stage=t.stage, tp_rank=t.tp_rank, pp=plan.pp, te_spec=te_spec)
    ]
    device = next(iter(params.values())).device
    size = torch.empty((), dtype=dtype).element_size()
    received, start = 0, 0
    while start < len(messages):
        bucket, nbytes = [], 0
        while start < len(messages) and (not bucket or nbytes < TRANSFER_BUCKET_BYTES):
            t, item = messages[start]
            shape = shard_shape(item, arch, tp=plan.tp)
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
                write_shard(buffer, item, shard, arch, tp=plan.tp, tp_rank=t.tp_rank)
    return received


def _stream(model, arch: ModelArch, engine: WeightReceiver | None, dtype: str) -> None:
    """The whole model streamed to the one engine on rank 0: a collective over data-parallel
    rank 0's model-parallel group (the other ranks do nothing)."""
    if not in_engine_group():
        return
    stream = hf_weights(model, arch, dtype=dtype)
    if engine is None:
        for _ in stream:  # the collectives need every peer; the tensors are not needed here
            pass
    else:
        engine.update_weights(stream)


def _send_ipc():
    from cwgrpo_megatron.weight_sync.ipc import send_ipc

    return send_ipc


def _send_nccl():
    from cwgrpo_megatron.weight_sync.nccl import send_nccl

    return send_nccl


TRANSFERS = {"ipc": _send_ipc, "nccl": _send_nccl}
"""An owner's offer for an engine that takes its weights through vLLM's weight transfer (its
`transfer`), and the sender of each (imported when used: vLLM's transfer engines)."""


def _transfer_source(model, arch: ModelArch, dtype: str):
    """The model as vLLM's weight transfer reads it: a fresh `hf_weights` pass per iteration."""
    from cwgrpo_megatron.weight_sync.transfer import HFSource

    shapes, torch_dtype = hf_shapes(arch), DTYPES[dtype]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    names = export_names(arch, pp=pp, te_spec=use_transformer_engine())
    return HFSource(
        lambda: hf_weights(model, arch, dtype=dtype),
        [(name, torch_dtype, shapes[name]) for name in names],
    )


def _offer(
    engine: WeightReceiver | None, arch: ModelArch, dtype: str, *, direct: bool
) -> SharedWeights | str | None:
    """An owner's buffer (None for an engine that takes the stream, and on other ranks; the
    engine's `transfer` backend for one that takes vLLM's transfer, when `direct` allows it);
    ValueError when the owner's engine holds another model or cannot make its buffer."""
    if engine is None:
        return None
    check_engine(engine, arch)
    if engine.transfer is not None and direct:
        return engine.transfer
    try:
        return engine.shared_weights(DTYPES[dtype])
    except (OSError, RuntimeError) as err:  # e.g. too little shared memory
        raise ValueError(f"the rollout engine's weight buffer could not be made: {err}") from err


_visible: set[tuple[str, ...]] = set()


def _check_visible(buffers: list[SharedWeights], mine: list[SharedWeights], group) -> None:
    """Every rank sees its node's buffers (`mine`); ValueError on every rank if one does not.
    Checked once per set of buffers (`buffers`, the same on every rank, so that every rank
    agrees on whether to check)."""
    key = tuple(b.token for b in buffers)
    if key in _visible:
        return
    with fail_together("reaching the engines' weight buffers", group):
        for buffer in mine:
            if not buffer.visible():
                raise ValueError(
                    f"this rank cannot see the weight buffer {buffer.path} of an engine on its "
                    "node: the ranks of a node must share rollout.shm_dir (docker: --ipc=host)"
                )
    _visible.add(key)


def score(model, arch: ModelArch, tokens: torch.Tensor) -> torch.Tensor | None:
    """log p(x_t | x_<t) `[b, s-1]` at temperature 1 from the vocab-parallel logits, on rank 0
    of the engine group (sent from the last stage over PP); None on ranks outside that group."""
    if not in_engine_group():
        return None
    # on the model's device: the zeros of the other stages are broadcast over NCCL on a GPU
    tokens = tokens.to(next(unwrap(model).parameters()).device)
    logits = forward_logits(model, tokens)
    last = parallel_state.is_pipeline_last_stage()
    logp = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, device=tokens.device)
    if last:
        target = tokens[:, 1:]
        logp, _ = vocab_parallel_logprob_entropy(
            logits[:, :-1].float().contiguous(),
            target,
            group=parallel_state.get_tensor_model_parallel_group(),
            vocab_size=arch.vocab_size,
        )
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    return broadcast_from(logp.float(), src, pp_group).cpu()
