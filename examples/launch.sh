#!/usr/bin/env bash
# The body of every recipe launcher (examples/train_cwgrpo_*.sh): a recipe names its config and
# hands itself to this file, which is both a bash script and a Python program.
#
# bash: `bash examples/launch.sh RECIPE_SCRIPT ARGS...` (what `bash examples/train_cwgrpo_7b.sh`
#   does) reads `""":"` as the no-op command `:` and execs torchrun on RECIPE_SCRIPT with
#   Megatron-LM's launch variables: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1),
#   MASTER_PORT (29500) and GPUS_PER_NODE (8).
# Python: torchrun runs the recipe script with Python, which reads everything from `""":"` to
#   `":"""` as a string and runs this file with RECIPE set (runpy); what follows the string
#   starts the trainer on configs/RECIPE.yaml, with every --config of ARGS stacked on it. The here-document after
#   `exec` (read by bash, never run) hides the Python code from bash up to the last line,
#   `pass`, which does nothing in Python.
""":"
set -euo pipefail
script=${1:?usage: bash examples/launch.sh RECIPE_SCRIPT [ARGS...], as examples/train_cwgrpo_*.sh do}
shift
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" "$script" "$@"
: <<'pass'
":"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
from cwgrpo_megatron.train import main

# vLLM's engine processes start by `spawn`, which imports the recipe script again under another
# name: only the launched process trains
if __name__ == "__main__":
    recipe = str(REPO / "configs" / f"{RECIPE}.yaml")  # RECIPE: set by the recipe script
    sys.exit(main(sys.argv[1:], recipe=recipe))
pass
