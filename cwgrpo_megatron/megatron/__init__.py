"""The only package that imports megatron.core: model, CPU path, train step, checkpoints.

Submodules are imported explicitly (`from cwgrpo_megatron.megatron import parallel`), so that
importing this package alone does not import megatron.core.
"""

import warnings

# Warnings that megatron-core 0.16 raises about itself, which a user cannot act on:
# - without Transformer Engine and Apex (the CPU set-up, always), six of its modules each warn
#   at import that they fall back to torch. That fallback is the local layer spec which
#   `model.build_model` chooses on purpose there, and env.json records the spec a run used;
# - its own TransformerConfig default (cuda_graph_scope) warns on every model built;
# - its dist-checkpointing loader calls torch APIs that torch has deprecated.
for message, category in (
    (r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),
    (r"`load_state_dict` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
):
    warnings.filterwarnings("ignore", message=message, category=category)
