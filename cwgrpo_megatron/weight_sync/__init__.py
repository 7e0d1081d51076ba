"""Megatron -> rollout engine weight sync: full HF-named tensors streamed (`export`), or each
rank's shards written into a shared-memory buffer laid out as the HF model (`shm`)."""

from cwgrpo_megatron.weight_sync.export import ExportGroups, hf_tensors

__all__ = ["ExportGroups", "hf_tensors"]
