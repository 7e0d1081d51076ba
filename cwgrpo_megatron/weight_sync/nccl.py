"""Weights into vLLM engines on GPUs of their own (rollout.placement=separate) over NCCL, with
vLLM's own weight transfer (its `weight_transfer_config` with the `nccl` backend).

Each engine's owner, a trainer rank on the engine's node, and the engine's workers form an NCCL
group of their own, 1 + rollout.tp ranks, made at the engine's first sync: the owner (rank 0)
opens a TCP rendezvous on a free local port and the workers join it
(`LLM.init_weight_transfer_engine`). The group lives as long as the engine's `vllm.LLM`; an
engine rebuilt after a failed load makes a new one. Then every sync, every rank of the job in
lockstep:

    the whole model as HF-named full tensors in the engine dtype, on this rank's GPU
      (`megatron.publish.hf_weights`: PP broadcast and TP all-gather in its model-parallel
      group; one tensor alive at a time)
      -> on an owner: packed into vLLM's two alternating buffers of max(`buffer_bytes`, the
         largest tensor) and broadcast over the group; each worker unpacks every tensor and
         loads it (`LLM.update_weights`, which vLLM runs on a thread beside the broadcast)
      -> on the other ranks: dropped (the export's collectives need every rank)

NCCL cannot place two ranks of one group on one GPU, so this path needs engines on GPUs the
trainer does not use (`rollout.vllm_weights` refuses it otherwise). `weight_sync.senders`
takes it, as it takes IPC, only when no pipeline stage is on another node; otherwise every
owner would pull the stages its node lacks, and the shared-memory buffers move them once per
node.

Per sync for Qwen2.5-Math-7B in bf16 (15.2 GB), with two engines on a node's last two GPUs at
rollout.tp 1 (estimates; no GPU has run this): the export's TP all-gathers as for IPC
(~0.06-0.08 s at TP4), then 15.2 GB from each owner to its engine's GPU over NVLink (0.05-0.15 s
at 100-300 GB/s), overlapped with the export by the two buffers: about 0.2-0.3 s. The
shared-memory path it replaces writes 15.2 GB per engine into host memory and copies it back
onto the engine's GPU: 2-5 s.
"""

from __future__ import annotations

import weakref

from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)

from cwgrpo_megatron.common.processes import free_port
from cwgrpo_megatron.weight_sync.transfer import (
    BUFFER_BYTES,
    HFSource,
    LLMClient,
    NoClient,
    largest_bytes,
)

_senders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""An owner's open transfer to each of its engines, by the engine's `vllm.LLM`."""


def send_nccl(source: HFSource, llm=None, *, buffer_bytes: int = BUFFER_BYTES) -> None:
    """One sync: every rank of the job calls this at once; `llm` is the engine's `vllm.LLM`
    on its owner, None elsewhere. Collective over each model-parallel group (the export) and,
    on an owner, over its engine's NCCL group; none over the job's default group."""
    if llm is None:
        NCCLTrainerWeightTransferEngine(
            client=NoClient(), source=source, is_sender=False
        ).send_weights()
        return
    sender = _senders.get(llm)
    if sender is None:
        sender = _open(llm, source, buffer_bytes)
        _senders[llm] = sender
    sender.source = source
    sender.send_weights()


def _open(llm, source: HFSource, buffer_bytes: int) -> NCCLTrainerWeightTransferEngine:
    """The NCCL group of this owner (rank 0) and `llm`'s workers, over a rendezvous on this
    node (the workers run here)."""
    workers = llm.llm_engine.vllm_config.parallel_config.world_size
    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=1 + workers,
        rank=0,
        packed=True,
        packed_buffer_size_bytes=max(buffer_bytes, largest_bytes(source)),
    )
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=LLMClient(llm), source=source)
