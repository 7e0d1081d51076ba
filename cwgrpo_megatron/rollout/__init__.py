"""Rollout engines behind one protocol (`base.RolloutEngine`), chosen by name.

    engine = get_engine("vllm")(model_dir, dtype="float32", max_model_len=1024, seed=0)
    groups = engine.generate(prompt_ids, n=8, sampling=SamplingConfig(temperature=0.7))

Backends are imported only when asked for, so `import cwgrpo_megatron` never loads vLLM.
"""

from cwgrpo_megatron.registry import Registry
from cwgrpo_megatron.rollout.base import (
    Completion,
    RolloutEngine,
    RolloutGroup,
    SamplingConfig,
)

ROLLOUT_BACKENDS: Registry = Registry("rollout backend")


@ROLLOUT_BACKENDS.register("vllm")
def _vllm():
    from cwgrpo_megatron.rollout.vllm_engine import VLLMEngine

    return VLLMEngine


@ROLLOUT_BACKENDS.register("torch")
def _torch():
    from cwgrpo_megatron.rollout.torch_engine import TorchEngine

    return TorchEngine


def get_engine(name: str) -> type:
    """The engine class of backend `name` (imports it now)."""
    return ROLLOUT_BACKENDS.get(name)()


__all__ = [
    "ROLLOUT_BACKENDS",
    "Completion",
    "RolloutEngine",
    "RolloutGroup",
    "SamplingConfig",
    "get_engine",
]
