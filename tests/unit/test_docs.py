"""The documentation names only what exists: every path, link, config key and command-line flag
in README.md and docs/ (and the shipped benchmarks' SOURCES.md) is checked against the
repository, `config.py`'s dataclasses and each tool's argument parser; docs/config.md's tables
are the dataclasses' keys, types, defaults and docstrings; docs/metrics.md names only metrics
the code logs, explains every one the shipped runs logged, and tabulates those runs. Nothing in
the repository names a path outside it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
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


METRICS_GUIDE = ROOT / "docs" / "metrics.md"
METRIC_RANGES = runpy.run_path(str(ROOT / "tools" / "metric_ranges.py"), run_name="ranges")


def test_the_metrics_guide_table_is_the_shipped_runs(capsys):
    assert METRIC_RANGES["main"](["--check", str(METRICS_GUIDE)]) == 0, capsys.readouterr().out


def _shipped_metric_names() -> set[str]:
    return {
        name
        for path in METRIC_RANGES["SHIPPED"]
        for step in METRIC_RANGES["read_steps"](path)
        for name in step
        if name != "step"
    }


def _loggable_metric_names() -> set[str]:
    """Every name the code can log: the shipped runs', the losses', the phases' and the string
    literals of the package that look like metric names."""
    from cwgrpo_megatron.run.step_metrics import PHASES

    source = "\n".join(p.read_text() for p in (ROOT / "cwgrpo_megatron").rglob("*.py"))
    return (
        _shipped_metric_names()
        | {f"timing_s/{phase}" for phase in PHASES}
        | set(re.findall(r"\"([a-z_]+/[a-z0-9_@/]+)\"", source))
    )


def _guide_patterns() -> dict[str, re.Pattern]:
    """The metric names of the guide's prose (`family/name`; `<x>` any part, `@n` any n) of the
    families the code logs, as patterns."""
    prose = METRICS_GUIDE.read_text().split(METRIC_RANGES["TOOL"])[0]
    families = {name.split("/")[0] for name in _loggable_metric_names()}
    patterns = {}
    for span in _code_spans(prose):
        if re.fullmatch(r"[a-z_]+/[a-z0-9_@<>/]+", span) and span.split("/")[0] in families:
            pattern = re.escape(span).replace("@n", r"@\d+")
            patterns[span] = re.compile(re.sub(r"<[a-z_]+>", r"[^/]+", pattern))
    return patterns


def test_the_metrics_guide_names_only_what_is_logged_and_explains_every_shipped_metric():
    loggable, patterns = _loggable_metric_names(), _guide_patterns()
    unknown = sorted(n for n, p in patterns.items() if not any(p.fullmatch(x) for x in loggable))
    assert not unknown, f"docs/metrics.md names metrics the code does not log: {unknown}"
    unexplained = sorted(
        name
        for name in _shipped_metric_names()
        if not any(p.fullmatch(name) for p in patterns.values())
    )
    assert not unexplained, f"docs/metrics.md does not explain: {unexplained}"


def test_metric_ranges_tabulates_other_runs_and_names_a_bad_line(tmp_path, capsys):
    run = tmp_path / "my_run"
    run.mkdir()
    lines = [{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.5, "eval/x/avg@1": 1}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert METRIC_RANGES["main"](["--runs", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Steps: `my_run` 1-2." in out
    assert "| `reward/mean` | 0.25 -> 0.5 [0.25, 0.5] |" in out
    assert "| `eval/x/avg@1` | 1 |" in out
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2,\n')
    assert METRIC_RANGES["main"](["--runs", str(run)]) == 1
    assert f"{run / 'metrics.jsonl'}:2 is not a JSON line" in capsys.readouterr().err
