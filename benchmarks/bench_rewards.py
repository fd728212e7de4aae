"""Reward throughput of the default task (``task=basic_arithmetic_2d``) through the trainer's
task adapter, as a step and an evaluation score their rollouts.

Each round scores one step's worth of rollouts (``--prompts`` x ``--generations``: the CPU
default's 8 x 8) and one evaluation's (``--eval`` problems, one response each), on texts of
the three kinds a policy writes: the right answer, a wrong one, a ramble without an answer.
``--workers 0,2`` measures those reward-worker counts side by side in one process, their rounds
interleaved (0: the trainer process scores; code from before the workers knows only that).
Entries accumulate in ``results/bench_rewards.json`` under ``--label`` with the commit, the
machine and its load average; ``results/bench_rewards.png`` plots every entry
(``--plot-only`` redraws it from the JSON).

    OMP_NUM_THREADS=1 python benchmarks/bench_rewards.py --label after --workers 0,2
    git archive 5557931 nemo_d3s conf | tar -x -C /tmp/before    # the code before the workers
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/before python benchmarks/bench_rewards.py --label before \
        --workers 0

Reported per worker count: rewards per second (median over rounds), the start-up time (the
first call waits for the workers to import and build their task).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as C  # noqa: E402

NAME = "bench_rewards"


def _texts(problems, n_per, rng):
    """``n_per`` responses per problem, prompt-major: right, wrong, no answer, in turn."""
    out = []
    for p in problems:
        for j in range(n_per):
            kind = (j + rng.randrange(3)) % 3
            if kind == 0:
                out.append(f"Let me add the terms step by step.\nAnswer: {p.answer}")
            elif kind == 1:
                out.append(f"I think it is {p.answer}1.\nAnswer: {p.answer}1")
            else:
                out.append("The numbers are small, so " + "I will think " * 20)
    return out


def _adapter(workers):
    """The trainer's task adapter for the default task (its conf/task params)."""
    from nemo_d3s.train import compose_config
    from nemo_d3s.trainer import tasks_adapter as ta
    from nemo_d3s.trainer.build import plain

    cfg = compose_config(["task=basic_arithmetic_2d"])
    params, timeout = plain(cfg.task.params) or {}, float(cfg.trainer.reward_timeout_s)
    if hasattr(ta, "task_adapter"):
        return ta.task_adapter(cfg.task.name, params, timeout, workers)
    if workers:
        raise SystemExit("this code has no reward workers: --workers 0 only")
    return ta.TaskAdapter(ta.build_task(cfg.task.name, params), timeout_s=timeout)


def run(args) -> dict:
    counts = [int(x) for x in args.workers.split(",")]
    rng = random.Random(0)
    adapters, startup = {}, {}
    for w in counts:
        t0 = time.perf_counter()
        adapters[w] = _adapter(w)
        startup[w] = t0
    task = adapters[counts[0]].task
    problems = task.sample_train(args.prompts, rng)
    step_texts = _texts(problems, args.generations, rng)
    evals = task.eval_set()[: args.eval]
    eval_texts = _texts(evals, 1, rng)
    for w, a in adapters.items():  # the first call waits for the workers
        a.score(problems, step_texts, args.generations)
        startup[w] = time.perf_counter() - startup[w]
    rates = {w: {"step": [], "eval": []} for w in counts}
    try:
        for r in range(args.rounds):
            for w in counts[r % len(counts) :] + counts[: r % len(counts)]:
                a = adapters[w]
                t = time.perf_counter()
                _, failed = a.score(problems, step_texts, args.generations)
                rates[w]["step"].append(len(step_texts) / (time.perf_counter() - t))
                assert not failed, failed
                t = time.perf_counter()
                _, failed = a.score(evals, eval_texts, 1)
                rates[w]["eval"].append(len(eval_texts) / (time.perf_counter() - t))
                assert not failed, failed
    finally:
        for a in adapters.values():
            getattr(a, "close", lambda: None)()
    import nemo_d3s

    return {
        "label": args.label,
        # the code measured: "before" runs an export of the commit before the workers
        "nemo_d3s": os.path.dirname(os.path.abspath(nemo_d3s.__file__)),
        "rounds": args.rounds,
        "step_calls": len(step_texts),
        "eval_calls": len(eval_texts),
        "by_workers": {
            str(w): {
                "startup_s": startup[w],
                "step_rewards_per_s": C.median(rates[w]["step"]),
                "eval_rewards_per_s": C.median(rates[w]["eval"]),
            }
            for w in counts
        },
        "loadavg_1min": os.getloadavg()[0],
        "machine": C.machine_info(),
    }


def plot(data: dict, path: str) -> None:
    """Rewards per second of each entry and worker count, a step's calls beside an
    evaluation's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (f"{e['label']}\n{w} workers", r)
        for e in data["entries"]
        for w, r in sorted(e["by_workers"].items())
    ]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(bars), 3.6))
    x = range(len(bars))
    for i, (kind, name) in enumerate((("step", "a step's calls"), ("eval", "an evaluation's"))):
        ax.bar(
            [j + (i - 0.5) * 0.38 for j in x],
            [r[f"{kind}_rewards_per_s"] for _, r in bars],
            0.38,
            label=name,
        )
    ax.set(
        title="default task: rewards per second (median over rounds)",
        xticks=list(x),
        xticklabels=[name for name, _ in bars],
        ylabel="rewards / s",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", help="the entry's name (required unless --plot-only)")
    ap.add_argument("--workers", default="0,2", help="worker counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--eval", type=int, default=256)
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
    args = ap.parse_args()
    path = os.path.join(C.results_dir(), f"{NAME}.json")
    old = {"entries": []}
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
    if args.plot_only:
        plot(old, C.png_path(NAME))
        return
    if not args.label:
        ap.error("--label is required (the entry's name in the JSON)")
    row = run(args)
    old["entries"] = [e for e in old["entries"] if e["label"] != args.label] + [row]
    C.write_json(NAME, old)
    plot(old, C.png_path(NAME))
    for w, r in row["by_workers"].items():
        print(
            f"{args.label}, {w} workers: {r['step_rewards_per_s']:.0f} rewards/s (step), "
            f"{r['eval_rewards_per_s']:.0f} rewards/s (eval), start-up {r['startup_s']:.1f} s"
        )
    print(f"load average {row['loadavg_1min']:.1f}")


if __name__ == "__main__":
    main()
