"""The recipe launchers (examples/train_cwgrpo_*.sh) are bash scripts and Python programs that
name a recipe and run the one launcher body, examples/launch.sh: each parses as Python and
names a recipe that is a config that loads. `tests/e2e/test_launchers.py` checks them as bash
scripts, and `tests/e2e/test_train.py` launches one both ways."""

import ast
from pathlib import Path

import pytest

from cwgrpo_megatron.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(EXAMPLES.glob("train_cwgrpo_*.sh"))


def _recipe(script: Path) -> str:
    """The RECIPE that `script` hands to launch.sh."""
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Dict):
            pairs = dict(zip(node.keys, node.values, strict=True))
            for key, value in pairs.items():
                if isinstance(key, ast.Constant) and key.value == "RECIPE":
                    return value.value
    raise AssertionError(f"{script.name} names no RECIPE")


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"train_cwgrpo_7b.sh", "train_cwgrpo_1p5b.sh"}


@pytest.mark.parametrize("script", RECIPES, ids=lambda p: p.name)
def test_recipe_names_a_config_that_loads(script):
    recipe = EXAMPLES.parent / "configs" / f"{_recipe(script)}.yaml"
    assert recipe.is_file(), f"{script.name}: {recipe} does not exist"
    load_config(recipe)
