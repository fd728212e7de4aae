#!/usr/bin/env bash
# Preemption: SIGTERM/SIGUSR1 finish the current step, write a checkpoint and exit 0;
# `resume=true` continues from the latest checkpoint (model, optimizer, RNG, schedule and
# data order), giving the same metrics as an uninterrupted run. With Slurm, ask for the
# signal ahead of the time limit: `#SBATCH --signal=B:USR1@300`.
set -euo pipefail
OUT=${1:-outputs/resume_demo}
python -m nemo_d3s.train experiment=smoke trainer.steps=40 trainer.save_every=5 output_dir="$OUT" &
PID=$!
sleep 20
kill -TERM "$PID"; wait "$PID" || true
python -m nemo_d3s.train experiment=smoke trainer.steps=40 trainer.save_every=5 output_dir="$OUT" resume=true
