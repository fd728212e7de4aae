"""Rollout generation on CPU: one call per prompt vs one batched call, side by side.

Methods (8 prompts x 8 samples x 48 new tokens by default; each is one step's rollouts):

- ``hf_generate_per_prompt``: ``model.generate`` once per prompt (``sampler=hf_generate``,
  ``trainer.generate_per_prompt=true``: layout-independent samples, the slow way);
- ``seeded_per_prompt``: the backend's seeded KV-cache sampler, once per prompt;
- ``seeded_batched``: the seeded sampler, all prompts in one call (the trainer default:
  per-prompt seeds keep the samples layout-independent).

Runs are interleaved round-robin so machine noise hits all methods alike; the table shows
medians and the ratio to ``hf_generate_per_prompt``. Writes
``benchmarks/results/bench_batched_generation.{json,png}``.

    python benchmarks/bench_batched_generation.py [--model smollm2-135m-instruct] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import machine_info, median, png_path, print_table, rotate, write_json  # noqa: E402

from nemo_d3s.backends.base import GenerationConfig  # noqa: E402
from nemo_d3s.backends.hf import HFBackend, HFBackendConfig  # noqa: E402

NAME = "bench_batched_generation"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="tiny-random, smollm2-135m-instruct or a folder",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="tiny-random model, 1 repeat, results/quick/"
    )
    a = ap.parse_args()
    if a.quick:
        a.model, a.repeats = "tiny-random", 1
    common = dict(model=a.model, device="cpu", dtype="float32", autocast=None)
    seeded = HFBackend(HFBackendConfig(**common))
    hf = HFBackend(HFBackendConfig(**common, sampler="hf_generate"))
    prompts = [
        f"Calculate {i} + {3 * i + 1}. End your reply with 'Answer: <number>'."
        for i in range(a.prompts)
    ]
    seeds = list(range(100, 100 + a.prompts))
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens)
    tokens = {}

    def run(name, fn):
        outs = fn()
        tokens[name] = sum(int(o.batch.response_mask.sum()) for o in outs)

    methods = {
        "hf_generate_per_prompt": lambda: [
            hf.generate([p], a.samples, cfg, s) for p, s in zip(prompts, seeds)
        ],
        "seeded_per_prompt": lambda: [
            seeded.generate([p], a.samples, cfg, [s]) for p, s in zip(prompts, seeds)
        ],
        "seeded_batched": lambda: [seeded.generate(prompts, a.samples, cfg, seeds)],
    }
    for name, fn in methods.items():
        run(name, fn)  # warm-up
    times = {k: [] for k in methods}
    for r in range(a.repeats):
        for name in rotate(list(methods), r):
            t0 = time.perf_counter()
            run(name, methods[name])
            times[name].append(time.perf_counter() - t0)
    ref = median(times["hf_generate_per_prompt"])
    rows = [
        [
            k,
            f"{median(v):.2f} s",
            f"{ref / median(v):.2f}x",
            tokens[k],
            f"{tokens[k] / median(v):.0f}",
        ]
        for k, v in times.items()
    ]
    table = print_table(
        ["method", "median time", "speed-up vs hf per prompt", "response tokens", "tokens/s"], rows
    )
    print(
        f"model={a.model} threads={torch.get_num_threads()} {a.prompts} prompts x "
        f"{a.samples} samples x {a.max_new_tokens} new tokens"
    )
    write_json(
        NAME,
        {
            "machine": machine_info(),
            "config": vars(a),
            "times_s": times,
            "response_tokens": tokens,
            "table": table,
        },
        quick=a.quick,
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        names = list(times)
        ax.barh(names, [median(times[k]) for k in names], color=["#999999", "#6a9fd4", "#1f5fa8"])
        ax.set_xlabel("seconds per step's rollouts (median)")
        ax.set_title(
            f"{a.model}: {a.prompts} prompts x {a.samples} samples x {a.max_new_tokens} tokens"
        )
        fig.tight_layout()
        fig.savefig(png_path(NAME, a.quick), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
