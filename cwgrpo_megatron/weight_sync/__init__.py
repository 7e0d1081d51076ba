"""Megatron -> rollout engine weight sync: full HF-named tensors, streamed in buckets."""

from cwgrpo_megatron.weight_sync.export import ExportGroups, buckets, hf_tensors

__all__ = ["ExportGroups", "buckets", "hf_tensors"]
