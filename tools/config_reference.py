"""The config reference, read from the settings dataclasses: every key of a run's config with
its type, its default and the first sentence of its docstring, section by section.

    python tools/config_reference.py                          # print it
    python tools/config_reference.py --write docs/config.md   # refresh the generated block
    python tools/config_reference.py --check docs/config.md   # exit 1 when it is stale

tests/unit/test_docs.py runs `--check`, and fails on a key without a docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import typing

TOOL = "tools/config_reference.py"


def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring} of dataclass `cls`: the string literal under each field."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs = {}
    for field, after in zip(node.body, node.body[1:], strict=False):
        if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
            continue
        value = after.value if isinstance(after, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            docs[field.target.id] = inspect.cleandoc(value.value)
    return docs


def first_sentence(doc: str) -> str:
    """The docstring's first sentence, on one line: up to a period before a capital letter or
    the end (one inside `x.y`, `e.g.` or `et al. 2025` is kept)."""
    text = " ".join(doc.split("\n\n")[0].split())
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(?=\s+[A-Z]|$)", text)
    return text[: match.start() + 1] if match else text


def type_name(hint) -> str:
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def default_of(field: dataclasses.Field) -> str:
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def missing_docs() -> list[str]:
    """Keys of the config without a docstring."""
    return [key for key, _, _, doc in _rows() if not doc]


def _rows():
    from cwgrpo_megatron.config import Config

    sections = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = sections[section.name]
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for field in dataclasses.fields(cls):
            key = f"{section.name}.{field.name}"
            yield key, type_name(hints[field.name]), default_of(field), docs.get(field.name, "")


def generated() -> str:
    """One table per section: key, type, default, the first sentence of its docstring."""
    from cwgrpo_megatron.config import Config

    docs = field_docs(Config)
    lines, current = [], None
    for key, kind, default, doc in _rows():
        section = key.split(".")[0]
        if section != current:
            current = section
            if lines:
                lines.append("")
            lines += [f"## {section}", "", first_sentence(docs.get(section, "")), ""]
            lines += ["| key | type | default | |", "|---|---|---|---|"]
        kind, default, doc = (x.replace("|", "\\|") for x in (kind, default, first_sentence(doc)))
        lines.append(f"| `{key}` | `{kind}` | `{default}` | {doc} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from cwgrpo_megatron.common import generated_docs

    description = __doc__.split("\n\n")[0]
    return generated_docs.main(argv, tool=TOOL, description=description, generate=generated)


if __name__ == "__main__":
    sys.exit(main())
