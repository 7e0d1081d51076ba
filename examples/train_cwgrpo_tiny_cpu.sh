#!/usr/bin/env bash
# A tiny CW-GRPO run on CPU (configs/tiny_cpu.yaml): the launchers' smoke test, on any machine,
# before a GPU recipe. model.path is a tiny random Qwen2 (see configs/tiny_cpu.yaml).
#
#   GPUS_PER_NODE=2 bash examples/train_cwgrpo_tiny_cpu.sh model.path=/tmp/tiny parallel.tp=2
#   torchrun --nproc-per-node 2 examples/train_cwgrpo_tiny_cpu.sh model.path=/tmp/tiny
#
# Arguments go to `python -m cwgrpo_megatron.train` after the recipe: `--config FILE` overlays
# (repeatable, each on the ones before it) and `section.key=value` overrides. This file only
# names the recipe; examples/launch.sh is the launcher that both forms run, and says how.
""":"
exec bash "$(dirname "$0")/launch.sh" "$0" "$@"
: <<'pass'
":"""
import runpy
from pathlib import Path

launcher = str(Path(__file__).with_name("launch.sh"))
runpy.run_path(launcher, {"RECIPE": "tiny_cpu"}, run_name=__name__)
pass
