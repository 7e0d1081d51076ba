"""What every settings dataclass shares: value checks whose errors name the key and what is
allowed, and the warning for a setting that makes part of the run do nothing.

Each package declares the settings of its own parts (`algo/config.py`, `reward/config.py`, ...)
with these; `config.py` composes them into a run's `Config`.
"""

from collections.abc import Sequence


class ConfigWarning(UserWarning):
    """A setting that is allowed but makes part of the run do nothing."""


def check_choice(key: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        choices = ", ".join(map(str, allowed))
        raise ValueError(f"{key}={value!r} is not allowed; choose one of: {choices}")


def check_range(key: str, value: float, *, low: float, high: float | None = None) -> None:
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{key}={value!r} is out of range; it must be {bound}")


def check_length(
    prompt: tuple[str, int], completion: tuple[str, int], limit: tuple[str, int], *, also: str = ""
) -> None:
    """ValueError when a prompt of `prompt[1]` tokens and a completion of `completion[1]`
    exceed `limit[1]` tokens (a model's positions, an engine's length): the message names the
    three settings and numbers, and the fix (`also`: another way out, such as raising the
    limit)."""
    (pk, p), (ck, c), (lk, n) = prompt, completion, limit
    if p + c <= n:
        return
    fix = f"lower {ck} to {n - p} or less, or {pk}" if n - p >= 1 else f"lower {pk} below {n}"
    raise ValueError(f"{pk}={p} + {ck}={c} = {p + c} tokens exceed {lk}={n}: {fix}{also}")
