"""A standalone evaluation's engine (`tools/evaluate.py`): each setting from its flag, else from
the run's config when the model is a run's, else a default; the lengths checked against the
model's positions before any engine starts.

Lengths, in tokens: the completion's T, the engine's L, and a prompt budget B (longer prompts
are skipped, and counted). T defaults to the run's eval.max_tokens (else rollout.max_tokens),
else 4096 clamped to what the model's positions (or L) leave after B; L to the run's
rollout.max_model_len, else B + T; B to 1024, or with L known to L - T, the room a training
run's evaluation gives a prompt. Refused before any engine starts, each naming the flag to
change: B + T beyond the model's positions or L, and L beyond the positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cwgrpo_megatron.common.settings import check_length
from cwgrpo_megatron.eval.config import EvalConfig
from cwgrpo_megatron.rollout.config import RolloutConfig

PROMPT_TOKENS = 1024
"""The prompt budget without a run: room for every prompt of the five shipped benchmarks in
Qwen's tokenizer and chat template."""
MAX_TOKENS = 4096
"""The completion's length without a run, clamped to what the model's positions leave."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's own default: without a trainer beside it the engine may take most of the GPU."""


@dataclass(frozen=True)
class Lengths:
    max_prompt_tokens: int
    max_tokens: int
    max_model_len: int
    clamped: str | None = None
    """Why max_tokens is below its default (said to the user), or None."""


def resolve_lengths(
    positions: int | None,
    *,
    max_prompt_tokens: int | None,
    max_tokens: int | None,
    max_model_len: int | None,
    run: tuple[RolloutConfig, EvalConfig] | None = None,
) -> Lengths:
    """B, T and L from the flags (None: unset), else the `run`'s rollout and eval sections,
    else the defaults above; ValueError naming the flag to change when they do not fit
    `positions` (None: not known)."""
    if run is not None:
        rollout, evaluation = run
        max_tokens = _given(max_tokens, evaluation.max_tokens, rollout.max_tokens)
        max_model_len = _given(max_model_len, rollout.max_model_len)
    budget = _given(max_prompt_tokens, PROMPT_TOKENS)
    clamped = None
    if max_tokens is None:
        limit = min(x for x in (max_model_len, positions, budget + MAX_TOKENS) if x is not None)
        max_tokens = max(limit - budget, 1)  # below 1: the checks below say what to lower
        if max_tokens < MAX_TOKENS:
            clamped = (
                f"--max-tokens {max_tokens}: what the model's {limit} tokens leave after "
                f"--max-prompt-tokens {budget}"
            )
    if max_model_len is not None and max_prompt_tokens is None:
        budget = max(max_model_len - max_tokens, 1)  # every prompt the engine has room for
    for key, value in (("--max-prompt-tokens", budget), ("--max-tokens", max_tokens)):
        if value < 1:
            raise ValueError(f"{key} {value}: it must be at least 1")
    prompt, completion = ("--max-prompt-tokens", budget), ("--max-tokens", max_tokens)
    if positions is not None:
        if max_model_len is not None and max_model_len > positions:
            raise ValueError(
                f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings="
                f"{positions}: lower it to {positions} or less"
            )
        check_length(prompt, completion, ("the model's max_position_embeddings", positions))
    if max_model_len is None:
        max_model_len = budget + max_tokens
    check_length(prompt, completion, ("--max-model-len", max_model_len), also=", or raise it")
    return Lengths(budget, max_tokens, max_model_len, clamped)


def _given(*values):
    """The first value that is not None (None if all are)."""
    return next((v for v in values if v is not None), None)


def engine_config(
    run: RolloutConfig | None,
    lengths: Lengths,
    *,
    backend: str | None,
    tp: int | None,
    gpu_memory_utilization: float | None,
    enforce_eager: bool | None,
) -> RolloutConfig:
    """The engine's settings: the run's rollout section `run` (or the defaults, with vLLM's
    memory share) with the flags that were given and `lengths`, as one colocated engine that
    never sleeps and takes no weight updates."""
    base = run if run is not None else RolloutConfig()
    if run is None and gpu_memory_utilization is None:
        gpu_memory_utilization = GPU_MEMORY_UTILIZATION
    given = dict(
        backend=backend,
        tp=tp,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
    )
    return dataclasses.replace(
        base,
        **{key: value for key, value in given.items() if value is not None},
        max_tokens=lengths.max_tokens,
        max_model_len=lengths.max_model_len,
        placement="colocated",
        async_steps=0,
        gpus_per_node=0,
        weight_sync=None,
        sleep_level=0,
        in_process=None,
    )
