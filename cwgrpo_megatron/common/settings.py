"""What every settings dataclass shares: value checks whose errors name the key and what is
allowed, and the warning for a setting that makes part of the run do nothing.

Each package declares the settings of its own parts (`algo/config.py`, `reward/config.py`, ...)
with these; `config.py` composes them into a run's `Config`.
"""

from collections.abc import Mapping, Sequence


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


def signature_options(factory, *, provided: Sequence[str] = ()):
    """(the keyword arguments that `factory` (a class or a function) takes, the required ones
    among them), leaving out those in `provided` (the run passes them); None when it takes
    **kwargs (any option goes)."""
    import inspect

    params = list(inspect.signature(factory).parameters.values())  # a class's: without self
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = [
        p
        for p in params
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in provided
    ]
    return [p.name for p in named], [p.name for p in named if p.default is p.empty]


def check_options(
    key: str,
    kind: str,
    name: str,
    factory,
    options: Mapping,
    provided: Mapping[str, str] | None = None,
) -> None:
    """ValueError naming `key` (e.g. reward.options.cosine_length) when `options` do not suit
    `factory`'s signature: an unknown or misspelt option (the message lists the accepted
    ones), one that the run passes itself (`provided`: argument -> where its value comes from),
    or a required one missing."""
    provided = provided or {}
    for option in options:
        if option in provided:
            raise ValueError(
                f"{key}.{option}: {kind} {name!r} gets {option} from {provided[option]}; "
                "remove it here"
            )
    found = signature_options(factory, provided=tuple(provided))
    if found is None:
        return
    accepted, required = found
    for option in options:
        if option not in accepted:
            raise ValueError(
                f"{key}.{option}: {kind} {name!r} has no option {option!r}; it accepts: "
                f"{', '.join(accepted) or 'none'}"
            )
    missing = [r for r in required if r not in options]
    if missing:
        raise ValueError(
            f"{key}: {kind} {name!r} needs {', '.join(missing)}; set "
            + ", ".join(f"{key}.{m}" for m in missing)
        )
