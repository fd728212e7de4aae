#!/usr/bin/env bash
# Preemption by hand: start a run, wait for its first checkpoint, stop it with SIGTERM, then
# continue it from its folder alone.
#   bash examples/resume.sh [OUT]        (OUT: a new folder, default outputs/resume_demo)
# SIGTERM (like SIGUSR1 or a first Ctrl-C) finishes the current step, writes a checkpoint and
# exits 75 ("interrupted", nemo_d3s.train.EXIT_INTERRUPTED: `train && convert` stops there).
# `output_dir=OUT resume=true` continues from the latest checkpoint with the run's own
# config.yaml (model, optimizer, RNG, schedule and data order), giving the same metrics as an
# uninterrupted run. The script waits up to WAIT_S seconds (default 600) for the first
# checkpoint; it exits 0 when the resumed run finishes, non-zero with an `error:` line when
# the first run ends without a checkpoint, none appears in time, or the run does not stop
# with 75. With Slurm, ask for the signal ahead of the time limit:
# `#SBATCH --signal=B:USR1@300` (slurm/README.md).
set -euo pipefail
OUT=${1:-outputs/resume_demo}
WAIT_S=${WAIT_S:-600}

python -m nemo_d3s.train experiment=smoke trainer.steps=40 trainer.save_every=5 \
  output_dir="$OUT" &
PID=$!
# A checkpoint folder is renamed to step_* only once complete (trainer/checkpoint.py).
waited=0
until compgen -G "$OUT/checkpoints/step_*" >/dev/null; do
  if ! kill -0 "$PID" 2>/dev/null; then
    rc=0
    wait "$PID" || rc=$?
    echo "error: the run ended (exit code $rc) before writing a checkpoint in $OUT/checkpoints;" \
      "nothing to resume (see its output above)" >&2
    exit $((rc == 0 ? 1 : rc))
  fi
  if ((waited >= WAIT_S * 10)); then
    kill -TERM "$PID"
    wait "$PID" || true
    echo "error: no checkpoint in $OUT/checkpoints after ${WAIT_S} s (WAIT_S); the run was" \
      "stopped. Raise WAIT_S on a slow machine" >&2
    exit 1
  fi
  sleep 0.1
  waited=$((waited + 1))
done
echo "checkpoint $(compgen -G "$OUT/checkpoints/step_*" | head -n 1) written; sending SIGTERM"
kill -TERM "$PID"
rc=0
wait "$PID" || rc=$?
if ((rc != 75)); then
  echo "error: the run exited with $rc after SIGTERM, not 75 (interrupted at a checkpoint)" >&2
  exit $((rc == 0 ? 1 : rc))
fi
echo "stopped (exit code 75); resuming from $OUT"
exec python -m nemo_d3s.train output_dir="$OUT" resume=true
