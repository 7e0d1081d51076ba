"""Worker extension loaded inside vLLM's engine processes (`worker_extension_cls`).

Across processes `collective_rpc` serialises its arguments, so tensors would arrive as lists:
the trainer writes the weights into a shared-memory buffer (`weight_sync.shm`) and sends only
its layout. This module must stay importable without megatron (engine processes do not load
it).
"""

from __future__ import annotations


class WeightFileLoader:
    def cwgrpo_load_shared(self, message: dict) -> int:
        """Reload the whole model from the trainer's shared-memory buffer (views, no copy)."""
        from cwgrpo_megatron.weight_sync.shm import SharedWeights, mapped

        tensors = mapped(SharedWeights.from_message(message))
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)
