#!/usr/bin/env bash
# CW-GRPO on DeepSeek-R1-Distill-Qwen-1.5B (configs/r1_distill_qwen_1p5b.yaml, 8 GPUs a node).
#
#   torchrun --nnodes N --node-rank R --master-addr HOST --master-port P --nproc-per-node 8 \
#       examples/train_cwgrpo_1p5b.sh model.path=/models/R1-Distill-Qwen-1.5B [--config F] [k=v]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/train_cwgrpo_1p5b.sh model.path=...
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
runpy.run_path(launcher, {"RECIPE": "r1_distill_qwen_1p5b"}, run_name=__name__)
pass
