#!/usr/bin/env bash
# Data parallel on CPU: 2 processes (gloo). Prompts are sharded by rank, cross-group sample
# selection and the token top-K threshold are global, gradients are summed across ranks:
# the metrics match a 1-process run with the same trainer.prompts_per_step.
set -euo pipefail
OUT=${1:-outputs/torchrun_cpu}
torchrun --standalone --nproc_per_node=2 -m nemo_d3s.train experiment=smoke output_dir="$OUT"
