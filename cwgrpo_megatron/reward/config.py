"""The reward's settings: a weighted sum of registered rewards and how answers are verified."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from cwgrpo_megatron.common.settings import check_choice, check_options, check_range
from cwgrpo_megatron.reward.names import REWARDS, VERIFIERS

ON_ERROR = ("raise", "zero")
PROVIDED = {
    "workers": "reward.workers",
    "timeout_s": "reward.timeout_s",
    "max_tokens": "rollout.max_tokens",
}
"""Constructor arguments a reward gets from the run (when its signature names them)."""


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """The reward: a weighted sum of registered rewards, each with its own options."""

    MOVED: ClassVar[dict[str, str]] = {
        "cosine_max_len": "reward.options.cosine_length.max_len",
        "repetition_ngram": "reward.options.repetition.ngram",
        "repetition_max_penalty": "reward.options.repetition.max_penalty",
        "overlong_buffer_tokens": "reward.options.overlong.buffer_tokens",
        "overlong_penalty": "reward.options.overlong.penalty",
    }
    """Keys of earlier versions -> where their value goes now (`config.load_config` names it)."""

    weights: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0, "format": 1.0})
    """{reward name: weight}; e.g. {accuracy: 1.0, format: 1.0} or {format: 1.0,
    cosine_length: 1.0} (Open-RS's two recipes)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one answer verification; an overrun scores 0."""
    workers: int = 0
    """Verification processes; 0 means one per core."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """{reward name: {option: value}}, the keyword arguments of that reward's constructor,
    checked against its signature: e.g. {cosine_length: {max_len: 1000}, repetition: {ngram: 3,
    max_penalty: -1.0}, overlong: {buffer_tokens: 512, penalty: 1.0}} (docs/rewards-and-data.md
    lists the built-ins' options). A reward gets workers, timeout_s and max_tokens from the
    run (`PROVIDED`), not from here."""
    on_error: str = "raise"
    """A reward call that raises or overruns reward.call_timeout_s: raise (stop the run,
    naming the reward) or zero (score its completions 0 and count them in
    reward/<name>/errors)."""
    call_timeout_s: float | None = None
    """Wall-clock limit of each reward's call in training (one per generation round, over a
    replica's completions), run in a thread of its own; None: no limit. An overrun call is
    left running and counts as failed (reward.on_error), and so do that reward's calls until
    it returns."""
    verifier: str = "accuracy"
    """What decides a completion is correct (accuracy/mean, evaluation, and the parts that read
    the verdict): accuracy (math-verify on the last \\boxed{}) or integer_answer (the first
    integer, for the synthetic tasks)."""

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("reward.weights is empty; name at least one reward")
        for name, weight in self.weights.items():
            check_choice("reward.weights key", name, REWARDS.names())
            if weight != weight or weight in (float("inf"), float("-inf")):
                raise ValueError(f"reward.weights.{name}={weight} must be finite")
        check_choice("reward.verifier", self.verifier, VERIFIERS)
        check_range("reward.timeout_s", self.timeout_s, low=0.001)
        check_range("reward.workers", self.workers, low=0)
        check_choice("reward.on_error", self.on_error, ON_ERROR)
        if self.call_timeout_s is not None:
            check_range("reward.call_timeout_s", self.call_timeout_s, low=0.001)
        # a reward's options may stay in a recipe whose overlay weighs other rewards
        for name in dict.fromkeys([*self.options, *self.weights]):
            check_choice("reward.options key", name, REWARDS.names())
            options, reward = self.options.get(name, {}), REWARDS.get(name)
            check_options(f"reward.options.{name}", "reward", name, reward, options, PROVIDED)
