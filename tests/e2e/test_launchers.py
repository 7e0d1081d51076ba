"""Every launcher in examples/ is valid bash (`bash -n`), and the launcher body refuses to run
without the recipe script it launches, saying how it is called."""

import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", sorted(EXAMPLES.glob("*.sh")), ids=lambda p: p.name)
def test_launcher_is_valid_bash(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_launch_body_without_a_recipe_says_how_it_is_called():
    done = subprocess.run(
        ["bash", str(EXAMPLES / "launch.sh")], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0
    assert "usage: bash examples/launch.sh RECIPE_SCRIPT" in done.stderr
