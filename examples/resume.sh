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
# with 75; OUT must be new or empty (2 otherwise). A SIGTERM or Ctrl-C to this script goes to
# the run, which checkpoints; the script waits for it and exits with its code. With Slurm, ask
# for the signal ahead of the time limit: `#SBATCH --signal=B:USR1@600` (slurm/README.md).
set -euo pipefail
OUT=${1:-outputs/resume_demo}
WAIT_S=${WAIT_S:-600}
if [[ -n "$(ls -A "$OUT" 2>/dev/null)" ]]; then
  echo "error: $OUT holds files already (an earlier run?); this script starts a new run:" \
    "name a new folder, or continue that run with: python -m nemo_d3s.train" \
    "output_dir=$OUT resume=true" >&2
  exit 2
fi

# The run in its own process group: a Ctrl-C reaches this script alone, which passes it on
# once (twice would stop the run without a checkpoint). The traps come first: a signal that
# arrives while the run starts is passed on too, not lost.
PID=""
SENT=""
stop() {
  trap - TERM INT
  if [[ -z "$PID" ]]; then exit $((128 + $(kill -l "$1"))); fi
  [[ -n "$SENT" ]] || kill -"$1" "$PID" 2>/dev/null || true
  rc=0
  wait "$PID" || rc=$?
  echo "SIG$1: the run stopped with exit code $rc; continue it with: python -m nemo_d3s.train" \
    "output_dir=$OUT resume=true" >&2
  exit "$rc"
}
trap 'stop TERM' TERM
trap 'stop INT' INT
set -m
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
SENT=TERM
kill -TERM "$PID"
rc=0
wait "$PID" || rc=$?
if ((rc != 75)); then
  echo "error: the run exited with $rc after SIGTERM, not 75 (interrupted at a checkpoint)" >&2
  exit $((rc == 0 ? 1 : rc))
fi
echo "stopped (exit code 75); resuming from $OUT"
trap - TERM INT
exec python -m nemo_d3s.train output_dir="$OUT" resume=true
