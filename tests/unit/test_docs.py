"""The documentation names only what exists: every path, link, config key and command-line flag
in README.md and docs/ (and the shipped benchmarks' SOURCES.md) is checked against the
repository, `config.py`'s dataclasses and each tool's argument parser; docs/config.md's tables
are the dataclasses' keys, types, defaults and docstrings. Nothing in the repository names a
path outside it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import re
import runpy
import sys
import typing
from functools import cache
from pathlib import Path

import pytest

from cwgrpo_megatron.config import Config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "cwgrpo_megatron" / "eval" / "data" / "SOURCES.md",
]
TOP = ("cwgrpo_megatron", "tools", "configs", "examples", "tests", "benchmarks", "docs")
SECTIONS = typing.get_type_hints(Config)
FILE_SUFFIX = re.compile(r"\.(jsonl?|safetensors|py|ya?ml|txt|md|png|pt|gz|sh|sbatch|tsv)\b")


def _name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def _code_spans(text: str) -> list[str]:
    """Inline `code` outside fenced blocks."""
    prose = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.findall(r"`([^`\n]+)`", prose)


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"(?ms)^```[a-z]*\n(.*?)^```", text)


def _expand(path: str) -> list[str]:
    """`a/{b,c}.yaml` -> a/b.yaml, a/c.yaml."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [
        p
        for part in match.group(1).split(",")
        for p in _expand(path[: match.start()] + part + path[match.end() :])
    ]


def _exists(path: str) -> bool:
    return any(ROOT.glob(p) if "*" in p else (ROOT / p).exists() for p in _expand(path))


def _named_paths(text: str) -> set[str]:
    """Repository paths named in code: `tools/x.py`, and package-relative `megatron/y.py`."""
    found = set()
    for span in _code_spans(text) + _code_blocks(text):
        for token in re.findall(r"(?<![\w./-])([\w.{},*-]+(?:/[\w.{},*-]+)+/?)", span):
            token = token.rstrip(".,")
            first = token.split("/")[0]
            if first in TOP:
                found.add(token)
            elif token.endswith(".py") and (ROOT / "cwgrpo_megatron" / first).is_dir():
                found.add(f"cwgrpo_megatron/{token}")  # package-relative
    return found


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_named_paths_exist(doc):
    text = doc.read_text()
    missing = sorted(p for p in _named_paths(text) if not _exists(p))
    assert not missing, f"{_name(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_links_resolve(doc):
    links = re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link)]
    missing = sorted(link for link in local if link and not (doc.parent / link).exists())
    assert not missing, f"{_name(doc)} links to missing files: {missing}"


def _config_keys(text: str) -> set[tuple[str, str]]:
    """(section, key) of `section.key`, `section.key=value` and `section.key: value` in code
    spans, and of `section.key=value` overrides in code blocks."""
    keys = set()
    pattern = rf"({'|'.join(SECTIONS)})\.([a-z_0-9]+)"
    for span in _code_spans(text):
        match = re.fullmatch(pattern + r"(?:[=:].*)?", span.strip())
        if match and not FILE_SUFFIX.search(span):
            keys.add(match.groups())
    for block in _code_blocks(text):
        keys.update(re.findall(rf"(?<![\w./-]){pattern}=", block))
    return keys


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_config_keys_exist(doc):
    unknown = []
    for section, key in sorted(_config_keys(doc.read_text())):
        if (ROOT / "cwgrpo_megatron" / section).is_dir():
            package = importlib.import_module(f"cwgrpo_megatron.{section}")
            if (ROOT / "cwgrpo_megatron" / section / f"{key}.py").exists() or hasattr(package, key):
                continue  # a module or a function of the package (`rollout.build_engine`)
        fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
        if key not in fields:
            unknown.append(f"{section}.{key}")
    assert not unknown, f"{_name(doc)} names config keys that do not exist: {unknown}"


def _commands(text: str) -> list[str]:
    """Shell commands of the code blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in _code_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split(" #")[0] for line in joined.splitlines()]
    return commands


@cache
def _tool_help(tool: str) -> str:
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [tool, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            runpy.run_path(str(ROOT / tool), run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def _flags() -> list[tuple[str, str, str]]:
    """(doc, tool, --flag) for every flag of a tools/*.py command in the docs."""
    found = set()
    for doc in DOCS:
        for command in _commands(doc.read_text()):
            match = re.search(r"(tools/\w+\.py)(.*)", command)
            if match:
                for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", match.group(2)):
                    found.add((_name(doc), match.group(1), flag))
    return sorted(found)


@pytest.mark.parametrize(("doc", "tool", "flag"), _flags())
def test_tool_flags_exist(doc, tool, flag):
    assert re.search(rf"(?<![\w-]){re.escape(flag)}\b", _tool_help(tool)), (
        f"{doc}: {tool} has no {flag}"
    )


def _repository_files():
    for name in (*TOP, ".ci"):
        yield from (p for p in (ROOT / name).rglob("*") if "__pycache__" not in p.parts)
    yield from (p for p in ROOT.iterdir() if p.is_file())


def test_nothing_names_a_path_outside_the_repository():
    outside = re.compile("|".join([r"\.\./" + "shared", r"\"" + "shared" + r"\" / \"data\""]))
    offenders = []
    for path in _repository_files():
        if path.suffix in (".png", ".gz", ".pt") or not path.is_file():
            continue
        with contextlib.suppress(UnicodeDecodeError):
            if outside.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"these name a folder outside the repository: {offenders}"


CONFIG_REFERENCE = runpy.run_path(str(ROOT / "tools" / "config_reference.py"), run_name="ref")


def test_the_config_reference_matches_the_code_and_every_key_has_a_line(capsys):
    assert CONFIG_REFERENCE["missing_docs"]() == [], "these config keys have no docstring"
    doc = ROOT / "docs" / "config.md"
    assert CONFIG_REFERENCE["main"](["--check", str(doc)]) == 0, capsys.readouterr().out
    keys = {f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(SECTIONS[s])}
    assert set(re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", doc.read_text(), re.M)) == keys
