"""Worker extension loaded inside vLLM's engine processes (`worker_extension_cls`).

Across processes `collective_rpc` pickles its arguments, so tensors would arrive as lists: the
trainer writes each bucket as a safetensors file in shared memory and sends only the paths.
This module must stay importable without megatron (engine processes do not load it).
"""

from __future__ import annotations


class WeightFileLoader:
    def cwgrpo_reload_from_files(self, paths: list[str]) -> int:
        """Reload the whole model from bucket files, one file in memory at a time."""
        from safetensors.torch import load_file

        def stream():
            for path in paths:
                yield from load_file(path).items()

        self.reload_weights(weights_iterator=stream())
        return len(paths)
