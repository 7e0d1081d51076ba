"""Weights into colocated vLLM engines over CUDA IPC, with vLLM's own weight transfer (its
`weight_transfer_config` with the `ipc` backend): the GPU path of the sync.

Every rank of the job, in lockstep:

    the whole model as HF-named full tensors in the engine dtype, on this rank's GPU
      (`megatron.publish.hf_weights`: PP broadcast and TP all-gather in its model-parallel
      group; one tensor alive at a time)
      -> packed into one reusable IPC buffer of `buffer_bytes` on the GPU
      -> when full: one all_gather_object of the buffer's IPC handle over the default group
         (every GPU's handle, keyed by its UUID), then the engine owners ship the handles to
         their engine (`LLM.update_weights`): each vLLM worker opens the handle of its own
         GPU and loads the tensors; a barrier before the buffer is reused

Nothing leaves the GPU. `weight_sync.senders.build_sender` takes this path only when every
engine's node holds every shard (no pipeline stage on another node): the export's
collectives then stay inside the node. Otherwise it keeps the shared-memory buffers, whose plan
sends a shard a node lacks across the network once for the node rather than once for each of
its GPUs. This path needs a trainer rank on every engine GPU (rollout.placement=colocated);
engines on GPUs of their own take `weight_sync.nccl`. vLLM's `IPCTrainerWeightTransferEngine`
treats its "rank 0" as the one that drives the engine; here each engine owner is that sender
for its own engine (`rank=0`), and the handle all-gather over the whole job merges every GPU's
handle, of which each worker takes its own.

Per sync and GPU, for Qwen2.5-Math-7B in bf16 (15.2 GB) at TP4 with an engine on every GPU
(estimates; no GPU has run this): the TP all-gathers bring 11.4 GB over NVLink (~0.06-0.08 s),
the model passes once through the buffer and once into the engine's weights (2 x 15.2 GB of
device copies, ~0.02 s), and 15 buffer-fulls each cost a handle all-gather, a barrier and an
engine call (~0.1-0.3 s): about 0.2-0.4 s. The buffer path writes the model into each of the
node's 8 engine buffers in host memory and each engine reads its copy back: 8 x 15.2 GB each
way per node, several seconds. A failure inside vLLM's transfer, which runs its own
collectives over the default group, stops the other ranks at NCCL's timeout rather than at
our agreement.
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

from cwgrpo_megatron.weight_sync.transfer import (
    BUFFER_BYTES,
    HFSource,
    LLMClient,
    NoClient,
    largest_bytes,
)


def send_ipc(source: HFSource, llm=None, *, buffer_bytes: int = BUFFER_BYTES) -> None:
    """One sync: every rank of the job calls this at once; `llm` is the engine's `vllm.LLM`
    on its owner, None elsewhere. Collective over the default group (vLLM's handle
    all-gathers and barriers), and over each model-parallel group (the export)."""
    info = IPCTrainerInitInfo(
        rank=0 if llm is not None else 1,
        packed=True,
        packed_buffer_size_bytes=max(buffer_bytes, largest_bytes(source)),
    )
    client = LLMClient(llm) if llm is not None else NoClient()
    IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=source).send_weights()
