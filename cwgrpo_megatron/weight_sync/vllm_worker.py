"""Worker extension mixed into vLLM's worker (`worker_extension_cls`), in engine processes or
in-process.

Across processes `collective_rpc` serialises its arguments, so tensors would arrive as lists:
the trainer writes the weights into a shared-memory buffer (`weight_sync.shm`) and sends only
its layout. This module must stay importable without megatron (engine processes do not load
it).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class SharedWeightLoader:
    def cwgrpo_load_shared(self, message: dict) -> str:
        """Reload the whole model from the trainer's shared-memory buffer (views, no copy):
        in place where `vllm_inplace` covers the model, else through vLLM's `reload_weights`.
        Returns which of the two ("in_place" or "reload") ran."""
        from cwgrpo_megatron.weight_sync import shm, vllm_inplace

        buffer = shm.SharedWeights.from_message(message)
        tensors = shm.mapped(buffer)
        if vllm_inplace.supported(self.vllm_config):
            model = self.model_runner.get_model()
            if vllm_inplace.load_in_place(model, tensors, lambda n: shm.span(buffer, n)):
                return "in_place"
            if not getattr(self, "_cwgrpo_warned", False):
                self._cwgrpo_warned = True
                log.warning(
                    "%s has a parameter or layer the in-place load does not cover: weight "
                    "updates take vLLM's slower reload_weights",
                    type(model).__name__,
                )
        self.cwgrpo_reload(iter(tensors.items()))
        return "reload"

    def cwgrpo_reload(self, weights=None) -> None:
        """vLLM's `reload_weights` from `weights` (an iterator of HF-named tensors; None: the
        checkpoint), then the repacking of a tied output layer and of MoE experts that it
        skips on CPU (`vllm_inplace`)."""
        from cwgrpo_megatron.weight_sync import vllm_inplace

        if weights is None:
            self.reload_weights()
        else:
            self.reload_weights(weights_iterator=weights)
        if vllm_inplace.supported(self.vllm_config):
            model = self.model_runner.get_model()
            vllm_inplace.repack_tied(model)
            vllm_inplace.repack_experts(model)
