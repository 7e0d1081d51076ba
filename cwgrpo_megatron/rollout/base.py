"""What every rollout backend takes and returns, and the input checks they share.

A backend implements `RolloutEngine`. Log-probs it returns are those of the distribution the
token was actually sampled from: softmax((logits / temperature) restricted to the top-k / top-p
set). The trainer's old log-probs use softmax(logits / temperature) over the whole vocabulary,
so with top_p < 1 or top_k > 0 the two differ by the log of the kept probability mass; the
truncated importance weight (`algo.tis_cap`) corrects the loss for that gap, and the gap is
logged every step.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from cwgrpo_megatron.convert.arch import ModelArch
from cwgrpo_megatron.convert.mapping import hf_shapes
from cwgrpo_megatron.rollout.names import LONG_PROMPT_POLICIES
from cwgrpo_megatron.weight_sync.receiver import WeightReceiver
from cwgrpo_megatron.weight_sync.shm import SharedWeights

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineDeadError(RuntimeError):
    """The rollout engine's processes are gone (a crash, the OOM killer, a kill)."""


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Per-call sampling parameters; the trainer's temperature must be the same."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_tokens: int = 64
    seed: int | None = None
    """Makes a call reproducible (same prompts, n and seed: same samples). None: the engine
    draws a seed from its own generator."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (greedy is not RL)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Sampling log-prob of each token in `token_ids`, same length."""
    finish_reason: str
    """'stop' (an end-of-sequence token, included in token_ids) or 'length' (max_tokens)."""


@dataclass(frozen=True)
class RolloutGroup:
    """The n completions of one prompt."""

    prompt_ids: list[int]
    completions: list[Completion]
    policy_version: int
    """How many weight updates the engine had received when it sampled these."""
    truncated: bool = field(default=False)
    """The prompt was cut from the left to fit (long_prompt='truncate')."""


@runtime_checkable
class RolloutEngine(WeightReceiver, Protocol):
    """A rollout backend: generates and scores, and receives the trainer's weights
    (`WeightReceiver`'s methods)."""

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutGroup]:
        """n completions per prompt. `seeds[i]` makes prompt i's samples a function of that
        seed alone, whatever else is in the call (its j-th sample uses seeds[i] + j: space the
        seeds of one call at least n apart); None derives them from `sampling.seed`."""
        ...

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(x_t | x_<t) at temperature 1 for t >= 1 of each sequence (scoring only)."""
        ...

    def sleep(self, level: int) -> None:
        """Free GPU memory until `wake`: level 1 the KV cache (the weights go to host memory),
        2 the KV cache and the weights (they must be loaded again). Nothing on CPU."""
        ...

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take back what `sleep` freed: `tags` from "weights" and "kv_cache" (None: both);
        the engine generates again once both are back."""
        ...

    def shutdown(self) -> None: ...


def check_requests(
    prompts: Sequence[Sequence[int]],
    n: int,
    sampling: SamplingConfig,
    *,
    max_model_len: int,
    vocab_size: int,
    long_prompt: str = "error",
) -> tuple[list[list[int]], list[bool]]:
    """(prompts to run, which were truncated). Raises ValueError on input that cannot run.

    A prompt must leave room for `max_tokens` new tokens: len + max_tokens <= max_model_len.
    With long_prompt='truncate' a longer prompt keeps its LAST max_model_len - max_tokens tokens
    (the chat template's assistant prefix is at the end), and a warning counts them.
    """
    if long_prompt not in LONG_PROMPT_POLICIES:
        raise ValueError(f"long_prompt={long_prompt!r}; choose one of {LONG_PROMPT_POLICIES}")
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one completion per prompt")
    if not prompts:
        raise ValueError("no prompts given")
    room = max_model_len - sampling.max_tokens
    if room < 1:
        raise ValueError(
            f"max_tokens={sampling.max_tokens} leaves no room for a prompt in "
            f"max_model_len={max_model_len}; lower max_tokens or raise max_model_len"
        )
    out, cut = [], []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
        if len(ids) > room:
            if long_prompt == "error":
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={sampling.max_tokens} "
                    f"at most {room} fit in max_model_len={max_model_len}. Filter prompts by "
                    "length (data.max_prompt_length), or set rollout.long_prompt=truncate"
                )
            ids = ids[-room:]
        out.append(ids)
        cut.append(len(ids) < len(prompt))
    if any(cut):
        log.warning("%d of %d prompts truncated to %d tokens", sum(cut), len(cut), room)
    return out, cut


def check_sequences(sequences: Sequence[Sequence[int]], *, max_model_len: int) -> None:
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ValueError(f"sequence {i} has {len(seq)} tokens; scoring needs at least 2")
        if len(seq) > max_model_len:
            raise ValueError(f"sequence {i} has {len(seq)} tokens > max_model_len={max_model_len}")


def checked_weights(
    weights: Iterable[tuple[str, Tensor]], shapes: dict[str, tuple[int, ...]]
) -> Iterable[tuple[str, Tensor]]:
    """`weights`, passed through one at a time, failing on the first unknown name or wrong
    shape, and at the end if a tensor is missing or came twice (a partial update would leave a
    model mixing two policies)."""
    seen: set[str] = set()
    for name, tensor in weights:
        if name not in shapes:
            raise ValueError(f"weight update has unknown tensor {name!r} (not in the model)")
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(
                f"weight update: {name} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(shapes[name])}"
            )
        if name in seen:
            raise ValueError(f"weight update sends {name} twice")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(shapes) - seen)
    if missing:
        raise ValueError(f"weight update is missing {len(missing)} tensors, e.g. {missing[:3]}")


class EngineBase:
    """What every backend keeps: the checkpoint's architecture and HF tensor shapes (what an
    update must deliver), the request limits, the policy version and a seed source."""

    sync_path: str = "stream"
    """The weight path this engine takes (`weight_sync.names`): the stream, unless a backend
    has a buffer or vLLM's transfer."""

    def __init__(
        self, model_dir: str | os.PathLike, *, seed: int, max_model_len: int, long_prompt: str
    ) -> None:
        self.model_dir = str(model_dir)
        self.arch = ModelArch.from_hf_dir(model_dir)
        self.shapes = hf_shapes(self.arch)
        self.max_model_len = max_model_len
        self.long_prompt = long_prompt
        self.version = 0
        self._seeds = random.Random(seed)

    def _check_requests(self, prompts, n: int, sampling: SamplingConfig):
        return check_requests(
            prompts,
            n,
            sampling,
            max_model_len=self.max_model_len,
            vocab_size=self.arch.vocab_size,
            long_prompt=self.long_prompt,
        )

    def shm_buffer(self, dtype: torch.dtype) -> SharedWeights:
        raise NotImplementedError(f"{type(self).__name__} has no shm weight buffer")

    def load_shm(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no shm weight buffer")

    def load_transfer(self, send) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes no vLLM weight transfer")

    def _seed(self, sampling: SamplingConfig) -> int:
        """The call's seed: the caller's, else the next of the engine's own (reproducible runs
        that never draw from the trainer's RNG)."""
        return sampling.seed if sampling.seed is not None else self._seeds.getrandbits(31)

    def _prompt_seeds(
        self, sampling: SamplingConfig, count: int, n: int, seeds: Sequence[int] | None
    ) -> list[int]:
        """One seed per prompt: the caller's, else the call's seed + i * n (sample j of prompt i
        then uses seed + i * n + j, distinct from every other sample of the call)."""
        if seeds is not None:
            if len(seeds) != count:
                raise ValueError(f"{len(seeds)} seeds for {count} prompts: give one per prompt")
            return [int(s) for s in seeds]
        base = self._seed(sampling)
        return [base + i * n for i in range(count)]


SEED_SPACE = 2**31


def rollout_seed(seed: int, step: int, prompt: int, n: int) -> int:
    """The sampling seed of prompt `prompt` (its position in the step's batch) at `step`: a
    function of (seed, step, prompt) only, never of the engine's history or of which engine
    samples it, so a resumed run draws the same completions. Seeds of one step are n apart
    (sample j uses seed + j)."""
    base = (seed * 1_000_003 + step) * 2_654_435_761 % SEED_SPACE
    return (base + prompt * n) % (SEED_SPACE - n)
