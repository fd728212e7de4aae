"""The race's report: ``summarize`` (a race folder -> ``vs_trl.json``), ``render`` (that JSON
alone -> the docs/evidence.md section), ``plot``.

Per seed, the budget is the reference's training CPU seconds and the threshold its mean over
its last ``threshold_evals`` evals. An arm's curve puts each eval at the training CPU and wall
seconds summed over the steps before it (evaluation left out); time to threshold is the first
crossing, linear between the two evals around it, and counts only if it is within the budget
(on the CPU axis); "eval at budget" is the curve's value at the budget, linear between evals.
The arms' start and end times (``arms.jsonl``) are checked for overlap.
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_presets import mean_ci  # noqa: E402
from vs_trl_arms import ARMS, PHASES, REFERENCE, read_rows  # noqa: E402

BEGIN, END = "<!-- vs_trl:begin -->", "<!-- vs_trl:end -->"
# (D3S-family arm, the GRPO of the same trainer it is judged against, seed by seed)
PAIRS = (
    ("trl_d3s", "trl_grpo"),
    ("nd3s_d3s", "nd3s_grpo"),
    ("nd3s_d3s_floor", "nd3s_grpo"),
    ("nd3s_d3s_i", "nd3s_grpo"),
    ("nd3s_pods", "nd3s_grpo"),
)


def curve(steps: List[dict], evals: List[dict]) -> List[dict]:
    """[{step, cpu, wall, eval}]: each eval at the training seconds summed up to its step."""
    out = []
    for e in sorted(evals, key=lambda r: r["step"]):
        done = [r for r in steps if r["step"] <= e["step"]]
        out.append(
            {
                "step": e["step"],
                "cpu": sum(r["cpu_s"] for r in done),
                "wall": sum(r["wall_s"] for r in done),
                "eval": e["eval_reward_mean"],
            }
        )
    return out


def crossing(points: List[dict], threshold: float, axis: str) -> Optional[float]:
    """The ``axis`` value where the curve first reaches ``threshold``, linear between the two
    evals around it; None if it never does."""
    prev = None
    for p in points:
        if p["eval"] >= threshold:
            if prev is None:
                return p[axis]
            frac = (threshold - prev["eval"]) / (p["eval"] - prev["eval"])
            return prev[axis] + frac * (p[axis] - prev[axis])
        prev = p
    return None


def value_at(points: List[dict], x: float, axis: str = "cpu") -> Optional[float]:
    """The curve's eval at ``x`` on ``axis``, linear between evals; None past its last eval."""
    prev = None
    for p in points:
        if p[axis] >= x:
            if prev is None or p[axis] == prev[axis]:
                return p["eval"]
            frac = (x - prev[axis]) / (p[axis] - prev[axis])
            return prev["eval"] + frac * (p["eval"] - prev["eval"])
        prev = p
    return None


def overlaps(rows: List[dict]) -> List[str]:
    """Pairs of arm runs whose [start, end] intervals overlap, named."""
    rows = sorted(rows, key=lambda r: r["start"])
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if b["start"] < a["end"]:
                out.append(f"{a['arm']} s{a['seed']} / {b['arm']} s{b['seed']}")
    return out


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _run(d: Path, budget: Optional[float], threshold: Optional[float]) -> dict:
    steps = read_rows(d / "steps.jsonl")
    done = read_rows(d / "done.json")[0]
    points = curve(steps, read_rows(d / "eval.jsonl"))
    cpu = sum(r["cpu_s"] for r in steps)
    split = {k: _mean([r["split"][k][1] for r in steps]) for k in PHASES}
    per_step = _mean([r["cpu_s"] for r in steps])
    ttt_cpu = ttt_wall = None
    if threshold is not None:
        ttt_cpu = crossing(points, threshold, "cpu")
        if ttt_cpu is not None and budget is not None and ttt_cpu > budget * (1 + 1e-9):
            ttt_cpu = None  # reached only after the budget: not within it
        ttt_wall = None if ttt_cpu is None else crossing(points, threshold, "wall")
    return {
        "steps": len(steps),
        "stopped": done["stopped"],
        "cpu_s": cpu,
        "cpu_per_step": per_step,
        "wall_per_step": _mean([r["wall_s"] for r in steps]),
        "split_cpu": split,
        "update_tokens_per_step": _mean([r.get("update_tokens") for r in steps]),
        "load1": _mean([r.get("load1") for r in steps]),
        "eval_final": points[-1]["eval"] if points else None,
        "eval_at_budget": None if budget is None else value_at(points, budget),
        "time_to_threshold_cpu": ttt_cpu,
        "time_to_threshold_wall": ttt_wall,
        "curve": points,
        "steps_rows": [
            {k: r[k] for k in ("step", "t", "cpu_s", "wall_s", "update_tokens", "load1") if k in r}
            for r in steps
        ],
    }


def summarize(root: Path, threshold_evals: int = 2) -> dict:
    import json

    config = json.loads((root / "config.json").read_text())
    finished = {}
    for d in sorted((root / "runs").glob("*_s*")):
        name, _, seed = d.name.rpartition("_s")
        if name in ARMS and (d / "done.json").is_file():
            finished.setdefault(name, {})[int(seed)] = d
    seeds: Dict[int, dict] = {}
    for seed, d in sorted(finished.get(REFERENCE, {}).items()):
        evals = sorted(read_rows(d / "eval.jsonl"), key=lambda r: r["step"])
        last = evals[-threshold_evals:]
        seeds[seed] = {
            "budget_cpu_s": sum(r["cpu_s"] for r in read_rows(d / "steps.jsonl")),
            "threshold": _mean([e["eval_reward_mean"] for e in last]),
            "threshold_steps": [e["step"] for e in last],
        }
    arms = {}
    for name in ARMS:
        per_seed = {}
        for seed, d in sorted(finished.get(name, {}).items()):
            s = seeds.get(seed, {})
            per_seed[seed] = _run(d, s.get("budget_cpu_s"), s.get("threshold"))
        arms[name] = {"what": ARMS[name].what, "per_seed": per_seed, **_aggregate(per_seed, seeds)}
    rows = read_rows(root / "arms.jsonl")
    loads = [r["load1"] for r in read_rows(root / "load.jsonl")]
    ref = arms[REFERENCE]
    summary = {
        "config": config,
        "threshold_evals": threshold_evals,
        "seeds": seeds,
        "arms": arms,
        "arm_runs": rows,
        "overlaps": overlaps(rows),
        "load": {"samples": len(loads), "mean": _mean(loads), "max": max(loads, default=None)},
        "reference_split": {
            k: _mean([r["split_cpu"][k] for r in ref["per_seed"].values()]) for k in PHASES
        },
    }
    if (root / "compaction.json").is_file():
        summary["compaction"] = _compaction(json.loads((root / "compaction.json").read_text()))
    return summary


def _aggregate(per_seed: Dict[int, dict], seeds: Dict[int, dict]) -> dict:
    runs = list(per_seed.values())
    reached = [r["time_to_threshold_cpu"] for r in runs if r["time_to_threshold_cpu"] is not None]
    # not reached within the budget counts as the whole budget: a lower bound on the mean
    censored = [
        r["time_to_threshold_cpu"]
        if r["time_to_threshold_cpu"] is not None
        else seeds[s]["budget_cpu_s"]
        for s, r in per_seed.items()
        if s in seeds
    ]
    return {
        "runs": len(runs),
        "reached": len(reached),
        "steps": mean_ci([r["steps"] for r in runs]),
        "cpu_per_step": mean_ci([r["cpu_per_step"] for r in runs]),
        "wall_per_step": mean_ci([r["wall_per_step"] for r in runs]),
        "update_tokens_per_step": mean_ci([r["update_tokens_per_step"] for r in runs]),
        "eval_at_budget": mean_ci([r["eval_at_budget"] for r in runs]),
        "time_to_threshold_cpu": mean_ci(reached),
        "time_to_threshold_wall": mean_ci(
            [r["time_to_threshold_wall"] for r in runs if r["time_to_threshold_wall"] is not None]
        ),
        "time_to_threshold_cpu_censored": mean_ci(censored),
    }


def _compaction(rec: dict) -> dict:
    points = []
    for p in rec["points"]:
        med = p["median"]
        points.append(
            {
                "progress": p["progress"],
                "rows": p["rows"],
                "loss_tokens": p["loss_tokens"],
                "forward_tokens": p["forward_tokens"],
                "cpu_s": {k: v["cpu_s"] for k, v in med.items()},
            }
        )
    return {"settings": rec["settings"], "points": points}


# ------------------------------------------------------------------------------ render


def _fmt(mc, digits=1) -> str:
    m, h = mc
    if m != m:
        return "-"
    return f"{m:.{digits}f}" if h != h else f"{m:.{digits}f} ± {h:.{digits}f}"


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def render(summary: dict) -> str:
    """The docs/evidence.md section's body, from ``vs_trl.json`` alone."""
    c = summary["config"]
    seeds = {int(k): v for k, v in summary["seeds"].items()}
    lines = [
        "Regenerated by `python benchmarks/vs_trl.py report --out <run folder> --record "
        "benchmarks/results/vs_trl --doc docs/evidence.md` from "
        "`benchmarks/results/vs_trl/vs_trl.json`. The run: `python benchmarks/vs_trl.py run "
        f"--steps {c['steps']} --eval-every {c['eval_every']} --prompts-per-step "
        f"{c['prompts_per_step']} --num-generations {c['num_generations']} --max-new-tokens "
        f"{c['max_new_tokens']} --eval-size {c['eval_size']} --generate {c['generate']} "
        f"--keep {c['keep']} --seeds {c['seeds']} --arms {c['arms']}`, model "
        f"`{Path(c['model']).name}`, {c['cpus']} CPUs, one thread an arm.",
        "",
    ]
    rows = summary["arm_runs"]
    if rows:
        over = summary["overlaps"]
        first, last = _utc(min(r["start"] for r in rows)), _utc(max(r["end"] for r in rows))
        failed = [f"`{r['arm']}` seed {r['seed']}" for r in rows if r["exit"] != 0]
        lines.append(
            f"Arms ran one at a time: {len(rows)} arm runs from {first} to {last} UTC, "
            + ("none overlapping" if not over else f"OVERLAPPING: {'; '.join(over)}")
            + " (start and end of each in `arms.jsonl`)"
            + (
                f"; {len(failed)} failed and ran again from the start: {', '.join(failed)}."
                if failed
                else "."
            )
        )
    load = summary["load"]
    if load["samples"]:
        lines.append(
            f"The machine was shared: 1-minute load average mean {load['mean']:.1f}, max "
            f"{load['max']:.1f} on {c['cpus']} CPUs ({load['samples']} samples 30 s apart), so "
            "wall seconds are inflated by other jobs; CPU seconds (this arm's process, "
            "`getrusage`) much less, and the budget and the table's first columns use them."
        )
    lines.append("")
    if seeds:
        lines.append(
            "Per seed, the budget is the reference's (`trl_grpo`) training CPU seconds over its "
            f"{c['steps']} steps and the threshold its mean greedy eval over its last "
            f"{summary['threshold_evals']} evals ({c['eval_size']} problems): "
            + "; ".join(
                f"seed {s}: {v['budget_cpu_s']:.0f} CPU s, {v['threshold']:.3f} (steps "
                f"{', '.join(map(str, v['threshold_steps']))})"
                for s, v in sorted(seeds.items())
            )
            + ". Time to threshold counts training only, linear between evals, and only within "
            "the budget; eval at budget is the curve at the budget."
        )
        lines.append("")
    lines += _table(summary)
    lines += _split_table(summary)
    lines += _ceiling(summary)
    for a, b in PAIRS:
        lines += verdict(a, b, summary)
    lines += _compaction_lines(summary.get("compaction"))
    return "\n".join(lines).rstrip() + "\n"


def _table(summary: dict) -> List[str]:
    lines = [
        "| arm | seeds | steps in budget | CPU s / step | wall s / step | update tokens / step "
        "| eval at budget | CPU s to threshold | wall s to threshold | reached |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in summary["arms"].items():
        if not a["runs"]:
            continue
        stops = sorted({r["stopped"] for r in a["per_seed"].values()})
        lines.append(
            f"| `{name}` | {a['runs']} | {_fmt(a['steps'])} ({', '.join(stops)}) | "
            f"{_fmt(a['cpu_per_step'])} | {_fmt(a['wall_per_step'])} | "
            f"{_fmt(a['update_tokens_per_step'], 0)} | {_fmt(a['eval_at_budget'], 3)} | "
            f"{_fmt(a['time_to_threshold_cpu'], 0)} | {_fmt(a['time_to_threshold_wall'], 0)} | "
            f"{a['reached']} of {a['runs']} |"
        )
    lines += [
        "",
        "Means over seeds with 95% t intervals (none with one seed); the time columns average "
        "the seeds that reached the threshold within the budget. Arms: "
        + "; ".join(f"`{n}` {a['what']}" for n, a in summary["arms"].items() if a["runs"])
        + ".",
        "",
    ]
    return lines


def _split_table(summary: dict) -> List[str]:
    lines = [
        "CPU seconds per step by phase (mean over steps and seeds; `selection` holds the "
        "entropy / log-prob pass that scores tokens):",
        "",
        "| arm | " + " | ".join(PHASES) + " | generation share |",
        "|---|" + "---|" * (len(PHASES) + 1),
    ]
    for name, a in summary["arms"].items():
        if not a["runs"]:
            continue
        split = {k: _mean([r["split_cpu"][k] for r in a["per_seed"].values()]) for k in PHASES}
        total = sum(split.values())
        lines.append(
            f"| `{name}` | "
            + " | ".join(f"{split[k]:.1f}" for k in PHASES)
            + f" | {split['generation'] / total:.0%} |"
        )
    return lines + [""]


def _ceiling(summary: dict) -> List[str]:
    split = summary["reference_split"]
    total = sum(split.values())
    if not total or total != total:
        return []
    upd = split["update"] / total
    return [
        f"The ceiling on this machine: in the reference's step the update is {upd:.0%} of the "
        f"CPU seconds and generation {split['generation'] / total:.0%}. D3S's two levels cut the "
        f"update only, so even an update that cost nothing would make a step at most "
        f"{1 / (1 - upd):.2f}x cheaper; a larger time-to-quality gain has to come from needing "
        "fewer steps.",
        "",
    ]


def verdict(a: str, b: str, summary: dict) -> List[str]:
    """Seed by seed (the seeds both arms finished): where ``a`` is cheaper per step (CPU),
    reaches the threshold sooner within the budget (CPU), and ends the budget with a higher
    eval, and where not, with the numbers."""
    A, B = summary["arms"][a]["per_seed"], summary["arms"][b]["per_seed"]
    common = sorted(set(A) & set(B), key=int)
    if not common:
        return []
    n = len(common)
    cheaper = sooner = neither = higher = 0
    losses = []
    for s in common:
        x, y = A[s], B[s]
        what = []
        if x["cpu_per_step"] < y["cpu_per_step"]:
            cheaper += 1
        else:
            what.append(f"{x['cpu_per_step']:.1f} vs {y['cpu_per_step']:.1f} CPU s/step")
        tx, ty = x["time_to_threshold_cpu"], y["time_to_threshold_cpu"]
        if tx is None and ty is None:
            neither += 1
        elif tx is not None and (ty is None or tx < ty):
            sooner += 1
        elif tx is None:
            what.append("threshold not reached within the budget")
        else:
            what.append(f"threshold at {tx:.0f} vs {ty:.0f} CPU s")
        ex, ey = x["eval_at_budget"], y["eval_at_budget"]
        if ex is not None and ey is not None and ex > ey:
            higher += 1
        elif ex is not None and ey is not None:
            what.append(f"eval at budget {ex:.3f} vs {ey:.3f}")
        if what:
            losses.append(f"seed {s}: " + ", ".join(what))
    lines = [
        f"- `{a}` vs `{b}`, seed by seed: cheaper per step on {cheaper} of {n}; reaches the "
        f"threshold sooner on {sooner} of {n}"
        + (f" (neither within the budget on {neither})" if neither else "")
        + f"; higher eval at the budget on {higher} of {n}."
    ]
    if losses:
        lines.append(f"  Where `{a}` does not win: " + "; ".join(losses) + ".")
    return lines


def _compaction_lines(comp: Optional[dict]) -> List[str]:
    if not comp:
        return []
    s = comp["settings"]
    parts = []
    for p in comp["points"]:
        f, cpu = p["forward_tokens"], p["cpu_s"]
        parts.append(
            f"at progress {p['progress']:g} ({p['rows']['kept']} of {p['rows']['full']} rollouts, "
            f"{p['loss_tokens']['kept']} of {p['loss_tokens']['full']} tokens kept): forward "
            f"tokens {f['masked']} -> {f['compacted']}, update {cpu['masked']:.2f} -> "
            f"{cpu['compacted']:.2f} CPU s ({cpu['masked'] / cpu['compacted']:.1f}x; TRL GRPO's "
            f"whole-batch update {cpu['full']:.2f} s)"
        )
    return [
        "",
        "Compaction in the TRL plugin (`vs_trl.py compaction`: one batch of "
        f"{s['prompts_per_step']} prompts x {s['num_generations']} rollouts per schedule "
        "position, TRL's update on it with the kept rows masked and compacted, side by side, "
        f"medians of {s['repeats']}): " + "; ".join(parts) + ".",
    ]


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, a in summary["arms"].items():
        color = None
        for r in a["per_seed"].values():
            xs, ys = [p["cpu"] for p in r["curve"]], [p["eval"] for p in r["curve"]]
            (line,) = ax.plot(
                xs, ys, marker="o", ms=3, color=color, alpha=0.8, label=None if color else name
            )
            color = line.get_color()
    for v in summary["seeds"].values():
        ax.axvline(v["budget_cpu_s"], color="grey", lw=0.6, ls="--")
    ax.set_xlabel("training CPU seconds (evaluation left out); dashed: each seed's budget")
    ax.set_ylabel("eval reward (greedy)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_section(doc: Path, body: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {doc}: no {BEGIN} ... {END} section to regenerate")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{body}{END}{tail}")
