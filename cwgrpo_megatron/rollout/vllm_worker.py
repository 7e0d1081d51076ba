"""Worker extension loaded inside vLLM's engine processes (`worker_extension_cls`).

Across processes `collective_rpc` serialises its arguments, so tensors would arrive as lists:
the trainer writes the weights into a shared-memory buffer (`weight_sync.shm`) and sends only
its layout. This module must stay importable without megatron (engine processes do not load
it).
"""

from __future__ import annotations


class WeightFileLoader:
    def cwgrpo_load_shared(self, message: dict) -> str:
        """Reload the whole model from the trainer's shared-memory buffer (views, no copy):
        in place where `vllm_inplace` covers the model, else through vLLM's `reload_weights`.
        Returns which of the two ("in_place" or "reload") ran."""
        from cwgrpo_megatron.rollout import vllm_inplace
        from cwgrpo_megatron.weight_sync import shm

        buffer = shm.SharedWeights.from_message(message)
        tensors = shm.mapped(buffer)
        if vllm_inplace.supported(self.vllm_config) and vllm_inplace.load_in_place(
            self.model_runner.get_model(), tensors, lambda names: shm.span(buffer, names)
        ):
            return "in_place"
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return "reload"
