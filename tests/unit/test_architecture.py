"""The package's import graph, read from the source (every import statement, those inside
functions and under TYPE_CHECKING included), keeps the architecture that docs/architecture.md
draws:

- no cycle between packages (a subpackage, or a top-level module, is one node), and so none
  between modules;
- only `megatron/` imports Megatron-Core;
- `algo/` is pure tensor math: nothing from torch.distributed, Megatron, the collectives,
  the rollouts or the run's config;
- settings describe and never build: `config.py` and each package's `config.py` / `names.py`
  import only other settings modules;
- docs/architecture.md's tree and import table are the code's (`tools/architecture.py`).
"""

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCH = runpy.run_path(str(ROOT / "tools" / "architecture.py"), run_name="tools.architecture")
PACKAGE, imports, import_graph = ARCH["PACKAGE"], ARCH["imports"], ARCH["import_graph"]
find_cycle = ARCH["find_cycle"]

# what a settings module may import besides other settings modules: the shared checks, the
# registries, atomic writes (dump_config), and a model's description (json and arithmetic)
# for model.arch's check
SETTINGS_ALLOWED = {
    "cwgrpo_megatron.common.plugins",
    "cwgrpo_megatron.common.settings",
    "cwgrpo_megatron.common.registry",
    "cwgrpo_megatron.common.files",
    "cwgrpo_megatron.convert.arch",
}


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_no_cycle_between_packages():
    packages, why = ARCH["package_graph"]()
    cycle = find_cycle(packages)
    assert cycle is None, "import cycle between packages:\n" + "\n".join(
        why[a, b] for a, b in zip(cycle, cycle[1:], strict=False)
    )


def test_only_the_megatron_package_imports_megatron_core():
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in PACKAGE.rglob("*.py")
        if "megatron" not in path.relative_to(PACKAGE).parts[:-1]
        for name in imports(path)
        if name.split(".")[0] == "megatron"
    ]
    assert offenders == []


@pytest.mark.parametrize(
    "forbidden",
    [
        "torch.distributed",
        "megatron",
        "cwgrpo_megatron.comm",
        "cwgrpo_megatron.megatron",
        "cwgrpo_megatron.rollout",
        "cwgrpo_megatron.config",
    ],
)
def test_algo_is_pure(forbidden):
    offenders = [
        f"{path.name} imports {name}"
        for path in (PACKAGE / "algo").glob("*.py")
        for name in imports(path)
        if name == forbidden or name.startswith(forbidden + ".")
    ]
    assert offenders == []


def test_settings_import_no_implementation():
    graph = import_graph()
    settings = {
        m
        for m in graph
        if m == "cwgrpo_megatron.config" or m.rpartition(".")[2] in ("config", "names")
    }
    assert {"cwgrpo_megatron.algo.config", "cwgrpo_megatron.rollout.names"} <= settings
    offenders = [
        f"{module} imports {target}"
        for module in sorted(settings)
        for target in sorted(graph[module])
        if target not in settings | SETTINGS_ALLOWED
    ]
    assert offenders == []


def test_the_architecture_doc_matches_the_code(capsys):
    doc = ROOT / "docs" / "architecture.md"
    assert ARCH["main"](["--check", str(doc)]) == 0, capsys.readouterr().out
