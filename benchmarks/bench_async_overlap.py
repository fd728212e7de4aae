"""The CPU main job with generation overlapped with training (``rollout.max_staleness=1``) against
the synchronous loop (k = 0), side by side: steps/s (each step's wall time from one metrics row
to the next, the evaluation at its boundary left out; the first step left out), the held-out
reward at steps 10, 20 and 30, and where each step's time goes (the engine's seconds on its
rollouts, the update budget's seconds, the trainer's wait for rollouts, the share of generation
it did not wait through), over seeds.

Each (seed, arm) is one ``python -m nemo_d3s.train`` of the default experiment (SmolLM2-135M,
basic_arithmetic_2d, 8 prompts x 8 rollouts x 48 tokens, 30 steps, evaluations every 10),
arms interleaved seed by seed so machine load falls on both alike; the load average is
sampled around each run. A run already finished in ``--out`` is read, not run again; so is a
seed whose two arms the record already holds at the same steps, engine and overrides (the
record grows by seeds over sessions on machines that keep no run folders: each seed's two arms
still ran back to back on one machine, whose description each run carries).
Writes ``benchmarks/results/bench_async_overlap.{json,png}`` (``--rollout vllm``:
``bench_async_overlap_vllm.{json,png}``).

    python benchmarks/bench_async_overlap.py [--seeds 0,1,2] [--steps 30] [--rollout hf] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import machine_info, median, png_path, print_table, write_json  # noqa: E402

NAME = "bench_async_overlap"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_STEPS = (10, 20, 30)


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _rows(path: str) -> list:
    return [json.loads(x) for x in open(path) if x.strip()]


def run(a, seed: int, k: int, out: str) -> dict:
    """One training run (skipped when ``out`` holds a finished one); its summary."""
    done = os.path.join(out, "summary.json")
    load = {}
    if not os.path.isfile(done):
        cmd = [sys.executable, "-m", "nemo_d3s.train", f"output_dir={out}", f"seed={seed}"]
        cmd += [f"rollout={a.rollout}", f"rollout.max_staleness={k}", f"trainer.steps={a.steps}"]
        cmd += ["trainer.eval_every=10", "trainer.save_every=0", "trainer.export_hf=false"]
        cmd += ["logging.progress_bar=false", *a.overrides]
        shutil.rmtree(out, ignore_errors=True)  # an unfinished earlier attempt: start over
        load["before"] = _load()
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"seed {seed} k={k}: exit {r.returncode}\n{r.stderr[-3000:]}")
        load.update(after=_load(), wall_s=time.perf_counter() - t0)
        with open(os.path.join(out, "bench_run.json"), "w") as f:
            json.dump(load, f)
    elif os.path.isfile(os.path.join(out, "bench_run.json")):
        load = json.load(open(os.path.join(out, "bench_run.json")))
    rows = _rows(os.path.join(out, "metrics.jsonl"))
    eval_rows = _rows(os.path.join(out, "eval.jsonl"))
    evals = {e["step"]: e["eval_reward_mean"] for e in eval_rows}
    steady = rows[1:] if len(rows) > 1 else rows  # the first step pays one-off warm-up costs
    mean = lambda key: sum(r.get(key, 0.0) for r in steady) / len(steady)  # noqa: E731
    # A step's wall time from one row to the next (its ``time_step`` leaves out the boundary
    # after it: the refit and, at k >= 1, the wait for the batch the bound needs), less the
    # evaluation run at that boundary.
    eval_s = {e["step"]: e.get("time_eval", 0.0) for e in eval_rows}
    walls = [
        b["wall_time"] - a["wall_time"] - eval_s.get(a["step"], 0.0) for a, b in zip(rows, rows[1:])
    ]
    return {
        "seed": seed,
        "max_staleness": k,
        "steps": len(rows),
        "steps_per_s": len(walls) / sum(walls),
        "median_step_s": median(walls),
        "median_time_step_s": median([r["time_step"] for r in steady]),
        "generation_s": mean("time_generation"),
        "training_s": mean("time_training"),
        "wait_for_rollouts_s": mean("time_wait_for_rollouts"),
        "overlap_share": mean("time_overlap_share") if k else 0.0,
        "max_staleness_seen": max(r.get("rollout_staleness", 0.0) for r in rows),
        "eval_reward": {str(s): evals.get(s) for s in (0, *EVAL_STEPS)},
        "load": load,
    }


def _recorded_seeds(record: str, a) -> dict:
    """{seed: its two runs} of the existing record made at the same steps, engine and overrides;
    a run without its own machine description gets the record's."""
    path = os.path.join(REPO, "benchmarks", "results", f"{record}.json")
    try:
        old = json.load(open(path))
        cfg = old["config"]
        same = (cfg["steps"], cfg["rollout"], cfg.get("overrides", [])) == (
            a.steps,
            a.rollout,
            a.overrides,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not same:
        return {}
    by_seed: dict = {}
    for r in old.get("runs", []):
        by_seed.setdefault(r["seed"], []).append({"machine": old.get("machine"), **r})
    return {
        s: sorted(rs, key=lambda r: r["max_staleness"]) for s, rs in by_seed.items() if len(rs) == 2
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rollout", default="hf", help="hf (the seeded sampler) or vllm")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", NAME))
    ap.add_argument("--quick", action="store_true", help="1 seed, 3 steps, results/quick/")
    ap.add_argument("overrides", nargs="*", help="more training overrides for both arms")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.quick:
        seeds, a.steps = seeds[:1], 3
        a.overrides += ["task.eval_size=8", "trainer.max_new_tokens=16"]
    record = NAME if a.rollout == "hf" else f"{NAME}_{a.rollout}"
    kept = {} if a.quick else _recorded_seeds(record, a)
    runs = []
    for seed in seeds:
        if seed in kept:
            runs += kept[seed]
            print(f"seed {seed}: both arms read from the record", flush=True)
            continue
        here = machine_info()
        for k in (0, 1):
            out = os.path.join(a.out, a.rollout, f"seed{seed}_k{k}")
            runs.append({**run(a, seed, k, out), "machine": here})
            print(json.dumps(runs[-1]), flush=True)
    by = {k: [r for r in runs if r["max_staleness"] == k] for k in (0, 1)}
    rows = []
    for r in runs:
        rows.append(
            [
                r["seed"],
                r["max_staleness"],
                f"{r['steps_per_s']:.4f}",
                f"{r['generation_s']:.1f}",
                f"{r['training_s']:.1f}",
                f"{r['wait_for_rollouts_s']:.1f}" if r["max_staleness"] else "-",
                f"{r['overlap_share']:.2f}" if r["max_staleness"] else "-",
                *[f"{r['eval_reward'][str(s)]:.3f}" for s in EVAL_STEPS if a.steps >= s],
                f"{r['load'].get('before', float('nan')):.1f}",
            ]
        )
    head = ["seed", "k", "steps/s", "gen s", "train s", "wait s", "overlap"]
    head += [f"eval@{s}" for s in EVAL_STEPS if a.steps >= s] + ["load"]
    table = print_table(head, rows)
    speedups = [
        b["steps_per_s"] / s["steps_per_s"] for s, b in zip(by[0], by[1]) if s["seed"] == b["seed"]
    ]
    print("k=1 / k=0 steps/s by seed:", ", ".join(f"{x:.2f}x" for x in speedups))
    # one record per engine (the seeded sampler keeps the plain name the docs quote)
    write_json(
        record,
        {
            "machine": machine_info(),
            "config": {**vars(a), "seeds": seeds},
            "runs": runs,
            "speedup_by_seed": speedups,
            "table": table,
        },
        quick=a.quick,
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    colors = {0: "#999999", 1: "#1f5fa8"}
    for k in (0, 1):
        xs = [r["seed"] + (0.2 if k else -0.2) for r in by[k]]
        axes[0].bar(xs, [r["steps_per_s"] for r in by[k]], width=0.4, color=colors[k])
        for r in by[k]:
            steps = [s for s in (0, *EVAL_STEPS) if r["eval_reward"].get(str(s)) is not None]
            axes[1].plot(
                steps, [r["eval_reward"][str(s)] for s in steps], color=colors[k], marker="o"
            )
    axes[0].set_xlabel("seed (left: k = 0, right: k = 1)")
    axes[0].set_ylabel("training steps / s")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("held-out reward")
    axes[1].legend(
        handles=[plt.Line2D([], [], color=colors[k], marker="o", label=f"k = {k}") for k in (0, 1)]
    )
    fig.suptitle(f"CPU main job, rollout={a.rollout}: synchronous vs generation overlapped")
    fig.tight_layout()
    fig.savefig(png_path(record, a.quick), dpi=120)


if __name__ == "__main__":
    main()
