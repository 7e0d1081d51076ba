"""The only package that imports megatron.core: model, CPU path, train step, checkpoints.

Submodules are imported explicitly (`from cwgrpo_megatron.megatron import parallel`), so that
importing this package alone does not import megatron.core.
"""

import warnings

# Without Transformer Engine and Apex (the CPU set-up, always), six megatron-core modules each
# warn at import that they fall back to torch. The fallback is the local layer spec that
# `model.build_model` chooses on purpose there, and env.json records which spec a run used.
warnings.filterwarnings(
    "ignore",
    message=r"(Transformer Engine and Apex are|Apex is) not installed",
    category=UserWarning,
)
