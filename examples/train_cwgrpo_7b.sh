#!/usr/bin/env bash
# CW-GRPO on Qwen2.5-Math-7B (configs/qwen2p5_math_7b.yaml: the paper's recipe, 8 GPUs a node).
#
#   torchrun --nnodes N --node-rank R --master-addr HOST --master-port P --nproc-per-node 8 \
#       examples/train_cwgrpo_7b.sh model.path=/models/Qwen2.5-Math-7B [--config F] [key=value]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/train_cwgrpo_7b.sh model.path=...
#
# Arguments go to `python -m cwgrpo_megatron.train`: `--config FILE` (repeatable; when one is
# given it replaces the default recipe) and `section.key=value` overrides.
#
# The file is both a bash script and a Python program. torchrun runs its script with Python,
# which reads the first lines as comments and everything from `""":"` to `":"""` as a string,
# then starts the trainer; the last line, `pass`, does nothing. bash reads `""":"` as the no-op
# command `:`, runs the lines after it and `exec`s torchrun on this same file; the here-document
# that follows (read, never run) hides the Python code from bash up to the line `pass`. The
# bash form reads the Megatron-LM launch variables: NNODES (1), NODE_RANK (0), MASTER_ADDR
# (127.0.0.1), MASTER_PORT (29500) and GPUS_PER_NODE (8).
""":"
set -euo pipefail
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" "$0" "$@"
: <<'pass'
":"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
from cwgrpo_megatron.train import main  # noqa: E402

# vLLM's engine processes start by `spawn`, which imports this file again: only the launched
# process trains
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], default_config=str(REPO / "configs" / "qwen2p5_math_7b.yaml")))
pass
