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
