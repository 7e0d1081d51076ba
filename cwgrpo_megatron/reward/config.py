"""The reward's settings: a weighted sum of registered rewards and how answers are verified."""

from dataclasses import dataclass, field

from cwgrpo_megatron.common.settings import check_choice, check_range
from cwgrpo_megatron.reward.names import REWARDS, VERIFIERS


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """The reward: a weighted sum of registered rewards."""

    weights: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0, "format": 1.0})
    """{reward name: weight}; e.g. {accuracy: 1.0, format: 1.0} or {format: 1.0,
    cosine_length: 1.0} (Open-RS's two recipes)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one answer verification; an overrun scores 0."""
    workers: int = 0
    """Verification processes; 0 means one per core."""
    cosine_max_len: int = 1000
    """cosine_length: the token length at which the reward reaches its extreme."""
    repetition_ngram: int = 3
    """repetition: n of the word n-grams whose repeats are penalised (Open-R1: 3)."""
    repetition_max_penalty: float = -1.0
    """repetition: the reward of a completion made of one n-gram repeated (<= 0)."""
    overlong_buffer_tokens: int = 512
    """overlong: the last L tokens before rollout.max_tokens over which the penalty grows
    linearly (DAPO: 4,096 of 20,480)."""
    overlong_penalty: float = 1.0
    """overlong: the penalty at the limit, and beyond it (DAPO: 1.0)."""
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
        check_range("reward.cosine_max_len", self.cosine_max_len, low=1)
        check_range("reward.repetition_ngram", self.repetition_ngram, low=1)
        check_range("reward.overlong_buffer_tokens", self.overlong_buffer_tokens, low=1)
        check_range("reward.overlong_penalty", self.overlong_penalty, low=0.0)
        if self.repetition_max_penalty > 0:
            raise ValueError(
                f"reward.repetition_max_penalty={self.repetition_max_penalty} must be <= 0 "
                "(it is the reward of a fully repetitive completion)"
            )
