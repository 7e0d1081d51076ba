"""User plugins: Python modules or files that register rewards, losses, prompt schemas and
benchmarks under their own names, imported before a config is checked.

    run.plugins: [my_rewards, path/to/my_loss.py]       (or --plugin on train.py and the tools)

An entry ending in `.py` (or holding a `/`) is a file, imported under a name of its own
(`cwgrpo_plugin_<stem>_<hash of its path>`); any other entry is a module on `sys.path`.
`config.load_config` imports them, on every rank, before it builds the settings, so that what
they register (`REWARDS.register`, `register_policy_loss`, `SCHEMAS.register`,
`BENCHMARKS.register`) is a valid config value. Importing an entry twice in one process runs it
once. A plugin that fails to import raises `PluginError`, which names the entry and carries its
traceback. `PluginRecord`s (the file and its SHA-256) go into env.json and every checkpoint, and
a resume refuses a plugin whose file changed (`check_unchanged`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


class PluginError(ValueError):
    """A run.plugins entry could not be imported, or changed since a checkpoint."""


@dataclass(frozen=True)
class PluginRecord:
    entry: str
    """As the config names it."""
    file: str
    """The imported source file, absolute."""
    sha256: str

    def to_json(self) -> dict:
        return asdict(self)


_LOADED: dict[str, PluginRecord] = {}
"""Entries imported in this process (a module runs once, as `import` would)."""


def is_file_entry(entry: str) -> bool:
    return entry.endswith(".py") or "/" in entry


def load_plugins(entries: Sequence[str]) -> list[PluginRecord]:
    """Import each entry in order (once per process); the record of each."""
    return [_LOADED.get(_key(entry)) or _load(entry) for entry in entries]


def absolute_entry(entry: str) -> str:
    """A file entry as an absolute path (relative ones are read from the working directory); a
    module name as it is."""
    return str(Path(entry).expanduser().resolve()) if is_file_entry(entry) else entry


def _key(entry) -> str:
    return absolute_entry(entry) if isinstance(entry, str) else str(entry)


def _load(entry: str) -> PluginRecord:
    if not isinstance(entry, str) or not entry.strip():
        raise PluginError(f"run.plugins entry {entry!r} must be a module name or a .py file")
    try:
        module = _import_file(entry) if is_file_entry(entry) else importlib.import_module(entry)
    except PluginError:
        raise
    except ModuleNotFoundError as err:
        if err.name == entry or entry.startswith(f"{err.name}."):
            raise PluginError(
                f"run.plugins entry {entry!r}: no module of that name on the path ({sys.path[0]!r} "
                "first); give its file instead (path/to/plugin.py) or add its folder to "
                "PYTHONPATH"
            ) from None
        raise PluginError(_failed(entry, err)) from err
    except Exception as err:
        raise PluginError(_failed(entry, err)) from err
    source = getattr(module, "__file__", None)
    if source is None:
        raise PluginError(f"run.plugins entry {entry!r} is a namespace package: name a module")
    record = PluginRecord(entry=entry, file=str(Path(source).resolve()), sha256=_digest(source))
    _LOADED[_key(entry)] = record
    return record


def _import_file(entry: str):
    path = Path(entry).expanduser().resolve()
    if not path.is_file():
        raise PluginError(
            f"run.plugins entry {entry!r}: no such file ({path}; a relative path is read from "
            "the working directory)"
        )
    tag = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    name = f"cwgrpo_plugin_{path.stem}_{tag}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _failed(entry: str, err: BaseException) -> str:
    trace = "".join(traceback.format_exception(err)).rstrip()
    return f"run.plugins entry {entry!r} failed to import:\n{trace}"


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_unchanged(saved: Sequence[dict], current: Sequence[PluginRecord], *, where: str) -> None:
    """PluginError when a plugin that `saved` (a checkpoint's records) lists is missing from
    `current` or its file's hash differs: the checkpoint was trained with other code."""
    now = {r.entry: r for r in current}
    for old in saved:
        new = now.get(old["entry"])
        if new is None:
            raise PluginError(
                f"{where} was trained with plugin {old['entry']!r} ({old['file']}), which "
                "run.plugins no longer names: add it back, or start a new run.out_dir"
            )
        if new.sha256 != old["sha256"]:
            raise PluginError(
                f"plugin {old['entry']!r} changed since {where} was saved ({new.file}: sha256 "
                f"{old['sha256'][:12]} then, {new.sha256[:12]} now): restore the file, or start "
                "afresh in a new run.out_dir with the new code"
            )


def add_plugin_argument(parser) -> None:
    """`--plugin ENTRY` (repeatable) on an argparse parser: entries after run.plugins."""
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE|FILE.py",
        help="a plugin to import before the config is checked (as run.plugins; repeatable): "
        "a module name or a .py file that registers rewards, losses, schemas or benchmarks",
    )
