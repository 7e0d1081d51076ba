"""Name -> implementation registries for the swappable parts (losses, estimators, ...)."""

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table filled by a decorator; `get` fails with the list of known names.

    Usage:
        POLICY_LOSSES = Registry("policy loss", defined_in="cwgrpo_megatron.algo.losses")
        @POLICY_LOSSES.register("grpo")
        def grpo(...): ...
        POLICY_LOSSES.get("grpo")

    `defined_in` names the module whose import registers the built-in entries. It is imported
    on the first look-up, not when the registry is declared, so a registry lives in a
    names-only module (`algo/names.py`, ...) that settings can check values against without
    importing any implementation. Entries registered by other modules (a user's plugin
    imported before the config is loaded) are listed beside the built-in ones.
    """

    def __init__(self, kind: str, *, defined_in: str | None = None) -> None:
        self.kind = kind
        self._defined_in = defined_in
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item

        return decorator

    def _load(self) -> None:
        if self._defined_in is not None:
            importlib.import_module(self._defined_in)  # its decorators fill this table
            self._defined_in = None

    def get(self, name: str) -> T:
        self._load()
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items
