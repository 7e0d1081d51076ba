"""Megatron -> rollout engine weight sync, apart from Megatron itself: who writes which shard
where (`plan`), the shared-memory buffer laid out as the HF model (`shm`), full HF-named
tensors streamed (`export`), the receiver protocol engines implement (`receiver`), and vLLM's
side of the load (`vllm_worker`, `vllm_inplace`). The Megatron side is `megatron.publish`."""

from cwgrpo_megatron.weight_sync.export import ExportGroups, hf_tensors

__all__ = ["ExportGroups", "hf_tensors"]
