#!/usr/bin/env bash
# One Hydra sweep over down-sampling presets (each job gets its own folder), then one plot:
# reward vs step, vs update tokens processed, vs wall time.
set -euo pipefail
SWEEP=${SWEEP:-multirun/compare_presets}
# G = 8: at the smoke run's G = 4 pods' N = 1/4 keeps one rollout a prompt, refused (its
# re-normalised advantage is 0)
EXTRA=${EXTRA:-experiment=smoke trainer.num_generations=8 trainer.steps=12}
python -m nemo_d3s.train -m d3s=grpo,pods,d3s $EXTRA hydra.sweep.dir="$SWEEP"
python -m nemo_d3s.trainer.plot "$SWEEP/0" "$SWEEP/1" "$SWEEP/2" --label grpo --label pods --label d3s \
    -o "$SWEEP/reward.png"
echo "plot: $SWEEP/reward.png"
