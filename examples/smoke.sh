#!/usr/bin/env bash
# The whole training loop on a tiny random model and a toy reward: well under a minute.
set -euo pipefail
OUT=${1:-outputs/smoke}
python -m nemo_d3s.train experiment=smoke output_dir="$OUT"
python -m nemo_d3s.trainer.plot "$OUT" -o "$OUT/reward.png"
