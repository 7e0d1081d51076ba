"""Megatron -> rollout engine weight sync, apart from Megatron itself: the paths' names
(`names`), who writes which shard where (`plan`), the sender of each path (`senders`), the
shared-memory buffer laid out as the HF model (`shm`), full HF-named tensors streamed
(`export`), the receiver protocol engines implement (`receiver`), vLLM's side of the load
(`vllm_worker`, `vllm_inplace`), and the trainer's side of vLLM's own weight transfer on GPUs
(`transfer`, with its `ipc` and `nccl` senders). What the senders read of a Megatron model is
`megatron.publish`."""

from cwgrpo_megatron.weight_sync.export import ExportGroups, hf_tensors

__all__ = ["ExportGroups", "hf_tensors"]
