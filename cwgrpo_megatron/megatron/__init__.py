"""The only package that imports megatron.core: model, CPU path, train step, checkpoints.

Submodules are imported explicitly (`from cwgrpo_megatron.megatron import parallel`), so that
importing this package alone does not import megatron.core.
"""
