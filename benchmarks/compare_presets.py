"""Presets x seeds, side by side: does D3S / PODS help here, and by how much?

    python benchmarks/compare_presets.py --presets grpo,pods,d3s --seeds 5 --out runs/cmp \\
        [--variant gspo_d3s="d3s=d3s algorithm=gspo"] [--jobs 2] [-- hydra overrides for every run]

Each (variant, seed) is one ``python -m nemo_d3s.train`` run in ``OUT/runs/<variant>_s<seed>``
(a preset name P means the variant ``d3s=P``). Rerunning the command continues where it
stopped: finished runs (``summary.json``) are skipped, interrupted ones resume from their
checkpoints (``resume=true``), and a run that died before its first checkpoint is moved
aside (``.failed-N``) and started again. ``--jobs`` runs that many at once, each with
``OMP_NUM_THREADS = cores / jobs``, so timings compare runs that shared the machine alike.
Every run keeps what a training run keeps (``trainer.keep_last`` checkpoints and, by default,
a Hugging Face export): for many runs pass ``trainer.keep_last=1 trainer.export_hf=false``
after ``--``; the tables read only the records.

Writes ``OUT/table.md``, ``OUT/table.json`` and ``OUT/curves.png``: per variant the mean and
95% interval over seeds (Student t) of the final and best eval reward, the papers' selection
measures (kept-sample and kept-token ratios, Var(A) of the kept set vs the whole batch, the
share of kept samples with a non-zero advantage, the gradient norm relative to GRPO's),
loss-carrying update tokens and wall time; and the PODS papers' time-to-threshold: wall time
and update tokens until the eval reward first reaches 99% of the reference variant's
(``--reference``, default grpo) best mean eval reward, as a ratio reference / variant
(> 1 = sooner) with a seed-bootstrap 95% interval; every variant's eval reward after the
training time of the shortest run (equal compute: the runs train the same number of steps,
so a method with cheaper steps finishes sooner); and the final eval reward minus the
reference's, paired by seed (a seed fixes the prompts of every step and the eval set is
fixed, so the pairs share their data) with a 95% t interval over the pairs. Wall times leave
out evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

nan = float("nan")

REPO = Path(__file__).resolve().parents[1]

# Two-sided 97.5% Student t quantiles for 1..30 degrees of freedom (then the normal's 1.96).
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


# ---------------------------------------------------------------------------- statistics
def mean_ci(values: Sequence[float]) -> Tuple[float, float]:
    """(mean, half-width of the 95% t interval); half-width NaN with one value."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return m, t * sd / math.sqrt(n)


def bootstrap_ratio(
    ref: Sequence[Optional[float]],
    other: Sequence[Optional[float]],
    n_boot: int = 2000,
    seed: int = 0,
) -> Dict[str, float]:
    """Ratio mean(ref) / mean(other) of the seeds that reached the threshold (None = never),
    with a 95% percentile interval from resampling seeds within each variant. A resample in
    which no seed of a variant reached it is dropped; ``valid`` says how many were kept."""

    def ratio(a, b):
        a, b = [x for x in a if x is not None], [x for x in b if x is not None]
        if not a or not b or sum(b) == 0:
            return None
        return (sum(a) / len(a)) / (sum(b) / len(b))

    point = ratio(ref, other)
    rng = random.Random(seed)
    draws = []
    for _ in range(n_boot):
        r = ratio([rng.choice(ref) for _ in ref], [rng.choice(other) for _ in other])
        if r is not None:
            draws.append(r)
    draws.sort()
    if point is None or not draws:
        return {"ratio": None, "lo": None, "hi": None, "valid": len(draws) / n_boot}
    lo, hi = draws[int(0.025 * (len(draws) - 1))], draws[int(0.975 * (len(draws) - 1))]
    return {"ratio": point, "lo": lo, "hi": hi, "valid": len(draws) / n_boot}


# ---------------------------------------------------------------------------- runs
def read_jsonl(path: Path) -> List[dict]:
    rows = []
    if path.is_file():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"warning: {path}:{i} is not JSON; skipped", file=sys.stderr)
    return rows


def run_state(run_dir: Path) -> str:
    """done | resume | failed (started, no checkpoint) | new"""
    if (run_dir / "summary.json").is_file():
        return "done"
    if any((run_dir / "checkpoints").glob("step_*")):
        return "resume"
    return "failed" if run_dir.exists() else "new"


def launch(run_dir: Path, overrides: List[str], threads: int, log_dir: Path) -> int:
    state = run_state(run_dir)
    if state == "done":
        return 0
    if state == "failed":
        n = 1
        while run_dir.with_name(f"{run_dir.name}.failed-{n}").exists():
            n += 1
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.failed-{n}"))
    cmd = [sys.executable, "-m", "nemo_d3s.train", *overrides, f"output_dir={run_dir}"]
    if state == "resume":
        cmd.append("resume=true")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{run_dir.name}.log", "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        return subprocess.run(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode


def load_run(run_dir: Path) -> dict:
    """Per-eval curve joined with the step metrics: step, eval reward, cumulative loss-carrying
    update tokens and training wall time at that step; plus per-step selection and timing means.

    ``wall`` leaves out the time spent in evaluations: the trainer's ``wall_time`` at step s
    includes every evaluation before s (the one at s runs after the row is written), and a
    variant must not look slower or faster for how long its greedy answers take to decode.
    """
    metrics = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    evals = read_jsonl(run_dir / "eval.jsonl")
    curve = []
    for e in evals:
        m = metrics.get(e["step"], {})
        eval_before = sum(float(x.get("time_eval", 0.0)) for x in evals if x["step"] < e["step"])
        curve.append(
            {
                "step": e["step"],
                "eval": e["eval_reward_mean"],
                "tokens": m.get("update_tokens_total", 0.0),
                "wall": max(0.0, m.get("wall_time", 0.0) - eval_before) if m else 0.0,
            }
        )
    steps = [m for m in metrics.values() if not m.get("skipped")]
    every = list(metrics.values())

    def avg(key, rows=steps):
        vals = [m[key] for m in rows if key in m]
        return sum(vals) / len(vals) if vals else float("nan")

    last = metrics[max(metrics)] if metrics else {}
    step_time = avg("time_step", every)
    return {
        "curve": curve,
        "kept_sample_ratio": avg("kept_sample_ratio"),
        "kept_token_ratio": avg("kept_token_ratio"),
        "kept_adv_var": avg("kept_adv_var"),
        "adv_var_all": avg("adv_var_all"),
        "share_nonzero_adv": avg("share_nonzero_adv"),
        "grad_norm": avg("grad_norm"),
        "update_tokens_total": last.get("update_tokens_total", float("nan")),
        "wall_time": curve[-1]["wall"] if curve else last.get("wall_time", float("nan")),
        # where a step's time goes: generation is the part no selection can shrink
        "step_time": step_time,
        "generation_share": avg("time_rollout", every) / step_time
        if step_time == step_time and step_time
        else float("nan"),
        "reward_mean": avg("reward_mean", every),
    }


def paired_difference(runs: List[dict], ref_runs: List[dict]) -> dict:
    """Final eval reward of each run minus the reference run of the same ``seed``: mean and
    95% t half-width over the pairs, and how many pairs there were. Runs without a seed or
    without a reference partner are left out."""
    ref = {
        r["seed"]: r["curve"][-1]["eval"]
        for r in ref_runs
        if r.get("seed") is not None and r["curve"]
    }
    diffs = [
        r["curve"][-1]["eval"] - ref[r["seed"]] for r in runs if r.get("seed") in ref and r["curve"]
    ]
    m, h = mean_ci(diffs)
    return {"mean": m, "half_width": h, "pairs": len(diffs)}


def time_to(curve: List[dict], threshold: float, key: str) -> Optional[float]:
    for point in curve:
        if point["eval"] >= threshold:
            return point[key]
    return None


def value_at(curve: List[dict], x: float, key: str = "wall") -> Optional[float]:
    """Eval reward at ``x`` on the ``key`` axis, linear between eval points; None past the end."""
    pts = sorted((p[key], p["eval"]) for p in curve)
    if not pts or x > pts[-1][0] or x < pts[0][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1]


def summarize(runs: Dict[str, List[dict]], reference: str) -> dict:
    """runs: variant -> [load_run(...) per seed] -> the table (see the module docstring)."""
    out: Dict[str, dict] = {"reference": reference, "variants": {}}
    ref_runs = runs.get(reference, [])
    threshold = None
    if ref_runs:
        steps = sorted({p["step"] for r in ref_runs for p in r["curve"]})
        means = [
            mean_ci([p["eval"] for r in ref_runs for p in r["curve"] if p["step"] == s])[0]
            for s in steps
        ]
        if means:
            threshold = 0.99 * max(means)
    out["threshold"] = threshold
    ref_grad = mean_ci([r["grad_norm"] for r in ref_runs])[0] if ref_runs else float("nan")
    # Equal compute: every run's eval reward at the training time of the shortest run (the
    # runs train for the same steps, so a cheaper method has less time; this asks what each
    # had reached after the same seconds).
    ends = [r["curve"][-1]["wall"] for rs in runs.values() for r in rs if r["curve"]]
    out["equal_time"] = min(ends) if ends else None
    for name, rs in runs.items():
        row = {"seeds": len(rs)}
        row["eval_final"] = mean_ci([r["curve"][-1]["eval"] for r in rs if r["curve"]])
        row["eval_best"] = mean_ci([max(p["eval"] for p in r["curve"]) for r in rs if r["curve"]])
        for key in (
            "kept_sample_ratio",
            "kept_token_ratio",
            "kept_adv_var",
            "adv_var_all",
            "share_nonzero_adv",
            "update_tokens_total",
            "wall_time",
            "grad_norm",
            "step_time",
            "generation_share",
            "reward_mean",
        ):
            row[key] = mean_ci([r.get(key, float("nan")) for r in rs])
        if out["equal_time"] is not None:
            row["eval_at_equal_time"] = mean_ci(
                [value_at(r["curve"], out["equal_time"]) for r in rs if r["curve"]]
            )
        row["grad_norm_vs_reference"] = (
            row["grad_norm"][0] / ref_grad if ref_grad and ref_grad == ref_grad else None
        )
        row["eval_final_minus_reference"] = paired_difference(rs, ref_runs)
        if threshold is not None:
            for key, label in (("wall", "time_to_threshold"), ("tokens", "tokens_to_threshold")):
                mine = [time_to(r["curve"], threshold, key) for r in rs]
                ref = [time_to(r["curve"], threshold, key) for r in ref_runs]
                row[label] = {
                    "reached": sum(x is not None for x in mine),
                    "values": mine,
                    "speedup_vs_reference": bootstrap_ratio(ref, mine),
                }
        out["variants"][name] = row
    return out


def _fmt(mc: Tuple[float, float], digits: int = 3) -> str:
    m, h = mc
    if m != m:
        return "—"
    return f"{m:.{digits}f}" if h != h else f"{m:.{digits}f} ± {h:.{digits}f}"


def _ratio(d: Optional[dict]) -> str:
    if not d or d["speedup_vs_reference"]["ratio"] is None:
        return "—"
    r = d["speedup_vs_reference"]
    return f"{r['ratio']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}]"


def _paired(d: Optional[dict]) -> str:
    if not d or not d["pairs"] or d["mean"] != d["mean"]:
        return "—"
    if d["half_width"] != d["half_width"]:
        return f"{d['mean']:+.3f} (1 pair)"
    return f"{d['mean']:+.3f} ± {d['half_width']:.3f} ({d['pairs']})"


def table_md(summary: dict) -> str:
    ref = summary["reference"]
    th = summary["threshold"]
    lines = [
        f"Mean ± 95% interval over seeds. Threshold: 99% of {ref}'s best mean eval reward"
        + (f" = {th:.3f}." if th is not None else " (no reference runs)."),
        f"Speed-up = {ref}'s mean / the variant's mean, seed bootstrap 95% interval; "
        "reached = seeds that got there. Wall times leave out evaluation. "
        + (
            f"Eval @ {summary['equal_time']:.0f} s = each run's eval reward after the "
            "training time of the shortest run (linear between evaluations). "
            if summary.get("equal_time")
            else ""
        )
        + f"Final - {ref} = final eval reward minus {ref}'s of the same seed, mean ± 95% "
        "interval (pairs).",
        "",
        f"| variant | seeds | eval final | final - {ref} (paired) | eval best | eval @ "
        "equal time | kept samples | kept tokens | Var(A) kept | Var(A) all | A != 0 | "
        f"grad norm / {ref} | update tokens | train wall s | s / step | generation share | "
        "time to thr. (reached) | tokens to thr. (reached) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in summary["variants"].items():
        tt, tk = r.get("time_to_threshold"), r.get("tokens_to_threshold")
        gn = r["grad_norm_vs_reference"]
        lines.append(
            f"| {name} | {r['seeds']} | {_fmt(r['eval_final'])} | "
            f"{_paired(r.get('eval_final_minus_reference'))} | {_fmt(r['eval_best'])} | "
            f"{_fmt(r.get('eval_at_equal_time', (nan, nan)))} | "
            f"{_fmt(r['kept_sample_ratio'], 2)} | {_fmt(r['kept_token_ratio'], 2)} | "
            f"{_fmt(r['kept_adv_var'], 2)} | {_fmt(r['adv_var_all'], 2)} | "
            f"{_fmt(r['share_nonzero_adv'], 2)} | {'—' if gn is None else f'{gn:.2f}'} | "
            f"{_fmt(r['update_tokens_total'], 0)} | {_fmt(r['wall_time'], 0)} | "
            f"{_fmt(r['step_time'], 1)} | {_fmt(r['generation_share'], 2)} | {_ratio(tt)} "
            f"({tt['reached'] if tt else 0}/{r['seeds']}) | {_ratio(tk)} "
            f"({tk['reached'] if tk else 0}/{r['seeds']}) |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: Dict[str, List[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    lows: List[float] = []
    highs: List[float] = []
    for name, rs in runs.items():
        steps = sorted({p["step"] for r in rs for p in r["curve"]})
        if not steps:
            continue
        for ax, key, label in zip(
            axes,
            ("step", "tokens", "wall"),
            ("step", "loss-carrying update tokens", "training wall time (s, evaluation left out)"),
        ):
            xs, ms, hs = [], [], []
            for s in steps:
                pts = [p for r in rs for p in r["curve"] if p["step"] == s]
                xs.append(mean_ci([p[key] for p in pts])[0] if key != "step" else s)
                m, h = mean_ci([p["eval"] for p in pts])
                ms.append(m)
                hs.append(0.0 if h != h else h)
            line = ax.plot(xs, ms, marker="o", label=f"{name} ({len(rs)} seeds)")[0]
            # rewards live in [0, 1]: a two-seed t interval can reach far outside it
            ax.fill_between(
                xs,
                [max(0.0, m - h) for m, h in zip(ms, hs)],
                [min(1.0, m + h) for m, h in zip(ms, hs)],
                color=line.get_color(),
                alpha=0.12,
            )
            lows.extend(ms)
            highs.extend(ms)
            ax.set_xlabel(label)
    if lows:  # frame the means; the bands may run off the plot
        for ax in axes:
            ax.set_ylim(max(0.0, min(lows) - 0.1), min(1.0, max(highs) + 0.1))
    axes[0].set_ylabel("eval reward (greedy), mean ± 95% CI")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, List[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--presets",
        default="grpo,pods,d3s",
        help="comma-separated d3s presets (each = variant d3s=P)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="OVERRIDES"',
        help="an extra variant: a name and the Hydra overrides that define it (repeatable)",
    )
    p.add_argument(
        "--seeds", type=int, default=3, help="seeds 0..N-1 per variant (from --first-seed)"
    )
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds first..first+N-1: e.g. only the runs that shared the machine in one session",
    )
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(
        "--jobs", type=int, default=1, help="runs at once (threads per run = cores / jobs)"
    )
    p.add_argument(
        "--reference", default="grpo", help="the variant time-to-threshold is measured against"
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write the table from the runs there, run nothing",
    )
    args = p.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or args.first_seed < 0:
        p.error("--seeds and --jobs must be >= 1, --first-seed >= 0")
    return args, extra


def variants_of(args: argparse.Namespace) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for name in filter(None, (x.strip() for x in args.presets.split(","))):
        out[name] = [f"d3s={name}"]
    for spec in args.variant:
        name, sep, overrides = spec.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f'error: --variant {spec!r}: expected NAME="override override ..."')
        out[name.strip()] = shlex.split(overrides)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, extra = parse_args(argv)
    variants = variants_of(args)
    runs_dir, logs = args.out / "runs", args.out / "logs"
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(name, seed) for seed in seeds for name in variants]
    if not args.report_only:
        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        todo = [(n, s) for n, s in jobs if run_state(runs_dir / f"{n}_s{s}") != "done"]
        print(
            f"{len(jobs)} runs, {len(jobs) - len(todo)} already finished; {len(todo)} to "
            f"run, {args.jobs} at a time"
        )
        t0 = time.perf_counter()

        def one(job):
            name, seed = job
            rc = launch(
                runs_dir / f"{name}_s{seed}",
                [*variants[name], f"seed={seed}", *extra],
                threads,
                logs,
            )
            # 75 = nemo_d3s.train.EXIT_INTERRUPTED: stopped at a checkpoint by a signal
            verdict = (
                "ok"
                if rc == 0
                else "interrupted (exit 75): rerun to resume it"
                if rc == 75
                else f"FAILED (exit {rc}), see {logs}/{name}_s{seed}.log"
            )
            print(f"  {name} seed {seed}: {verdict} [{time.perf_counter() - t0:.0f} s]", flush=True)
            return rc

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            codes = list(pool.map(one, todo))
        if any(codes):
            print("some runs failed; rerun the same command to retry them", file=sys.stderr)
    loaded = {
        n: [
            {**load_run(runs_dir / f"{n}_s{s}"), "seed": s}
            for s in seeds
            if run_state(runs_dir / f"{n}_s{s}") == "done"
        ]
        for n in variants
    }
    loaded = {n: rs for n, rs in loaded.items() if rs}
    summary = summarize(loaded, args.reference)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.json").write_text(json.dumps(summary, indent=1))
    (args.out / "table.md").write_text(table_md(summary))
    plot(loaded, args.out / "curves.png")
    print((args.out / "table.md").read_text())
    print(f"wrote {args.out / 'table.md'}, table.json, curves.png")
    return 1 if not args.report_only and any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
