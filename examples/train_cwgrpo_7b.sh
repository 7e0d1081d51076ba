#!/usr/bin/env bash
# CW-GRPO on Qwen2.5-Math-7B (configs/qwen2p5_math_7b.yaml: the paper's recipe, 8 GPUs a node).
#
#   torchrun --nnodes N --node-rank R --master-addr HOST --master-port P --nproc-per-node 8 \
#       examples/train_cwgrpo_7b.sh model.path=/models/Qwen2.5-Math-7B [--config F] [key=value]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/train_cwgrpo_7b.sh model.path=...
#
# Arguments go to `python -m cwgrpo_megatron.train` after the recipe: `--config FILE` overlays
# (repeatable, each on the ones before it, e.g. configs/grpo_open_rs.yaml for the GRPO baseline)
# and `section.key=value` overrides. This file only names the recipe; examples/launch.sh is the
# launcher that both forms run, and says how.
""":"
exec bash "$(dirname "$0")/launch.sh" "$0" "$@"
: <<'pass'
":"""
import runpy
from pathlib import Path

launcher = str(Path(__file__).with_name("launch.sh"))
runpy.run_path(launcher, {"RECIPE": "qwen2p5_math_7b"}, run_name=__name__)
pass
