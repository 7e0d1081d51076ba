"""A reward with a setting: how close a completion's length comes to a target.

    run.plugins: [examples/plugins/length_target.py]
    reward.weights: {accuracy: 1.0, length_target: 0.5}
    reward.options: {length_target: {target: 256}}

r = -|L - target| / target, clamped to [-1, 0], with L the completion's tokens. Each completion
also reports its gap |L - target| in tokens and whether the problem row named a level: the
first key of the dict is the reward, the others are logged as reward/length_target/<key>.
"""

from cwgrpo_megatron.reward import Reward, register_reward


@register_reward("length_target")
class LengthTarget(Reward):
    def __init__(self, *, target: int, tolerance: int = 0) -> None:
        if target < 1:
            raise ValueError(f"target={target} must be >= 1 token")
        if tolerance < 0:
            raise ValueError(f"tolerance={tolerance} must be >= 0")
        self.target, self.tolerance = target, tolerance

    def __call__(self, *, completions, completion_lengths, extra=None, **_) -> list[dict]:
        rows = extra or [{}] * len(completions)
        out = []
        for length, row in zip(completion_lengths, rows, strict=True):
            gap = max(0, abs(int(length) - self.target) - self.tolerance)
            out.append(
                {
                    "score": -min(1.0, gap / self.target),
                    "gap": float(gap),
                    "has_level": float(row.get("level") is not None),
                }
            )
        return out
