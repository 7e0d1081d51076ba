"""The package's architecture, read from its source: the folder tree with each module's first
docstring line, and which package imports which (every import statement, those inside
functions and under TYPE_CHECKING included).

    python tools/architecture.py                              # print both
    python tools/architecture.py --write docs/architecture.md # refresh the generated block
    python tools/architecture.py --check docs/architecture.md # exit 1 when it is stale

The generated block of the doc sits between two marker lines (`common/generated_docs.py`); the
rest of the doc is prose. tests/unit/test_architecture.py runs `--check` and the rules of the graph.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cwgrpo_megatron"
TOOL = "tools/architecture.py"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of everything `path` imports (`from a import b` gives a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise ValueError(f"{path}: a relative import; the package uses absolute ones")
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    known = modules()

    def resolve(name: str) -> str | None:
        # `from a.b import c`: the module a.b.c if there is one, else a.b (c is a name in it)
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    return {
        module: {m for name in imports(path) if (m := resolve(name)) and m != module}
        for module, path in known.items()
    }


def node_of(module: str) -> str:
    """A node of the package graph: cwgrpo_megatron.algo.losses -> algo, .trainer -> trainer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<package>"


def package_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """(package -> packages it imports, (a, b) -> one module import that makes the edge)."""
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for module, targets in import_graph().items():
        for target in sorted(targets):
            a, b = node_of(module), node_of(target)
            if a != b and a != "<package>":
                edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{module} imports {target}")
    return edges, why


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as a closed walk [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def _summary(path: Path, most: int = 90) -> str:
    """The first sentence of the module's docstring, cut at a word past `most` characters."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    sentence = doc.split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
    if len(sentence) > most:
        sentence = sentence[:most].rpartition(" ")[0] + " ..."
    return sentence


def generated() -> str:
    """The doc's generated block: the tree, then each package's imports."""
    lines = ["```", "cwgrpo_megatron/"]
    top = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    folders = sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    width = 2 + max(len(p.name) for p in PACKAGE.rglob("*.py"))
    for path in top:
        lines.append(f"  {path.name:<{width + 2}}{_summary(path)}")
    for folder in folders:
        lines.append(f"  {folder.name + '/':<{width + 2}}{_summary(folder / '__init__.py')}")
        for path in sorted(folder.glob("*.py")):
            if path.name != "__init__.py":
                lines.append(f"    {path.name:<{width}}{_summary(path)}")
    lines += ["```", "", "| package | imports from the package |", "|---|---|"]
    edges, _ = package_graph()
    for node in sorted({node_of(module_name(p)) for p in [*top, *folders]} - {"<package>"}):
        lines.append(f"| `{node}` | {', '.join(f'`{b}`' for b in sorted(edges.get(node, ())))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from cwgrpo_megatron.common import generated_docs

    description = __doc__.split("\n\n")[0]
    return generated_docs.main(argv, tool=TOOL, description=description, generate=generated)


if __name__ == "__main__":
    sys.exit(main())
