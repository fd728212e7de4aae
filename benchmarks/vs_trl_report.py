"""The race's report: ``summarize`` (a race folder -> ``vs_trl.json``); ``vs_trl_tables.py``
renders that JSON alone (``render``: the docs/evidence.md section; ``plot``).

Per seed, the budget is the reference's training CPU seconds and the threshold its mean over
its last ``threshold_evals`` evals. An arm's curve puts each eval at the training CPU and wall
seconds summed over the steps before it (evaluation left out); time to threshold is the first
crossing, linear between the two evals around it, and counts only if it is within the budget
(on the CPU axis); "eval at budget" is the curve's value at the budget, linear between evals.
A seed that did not reach the threshold counts as the CPU seconds it spent looking for it (the
budget; the wall seconds at the budget) in the censored mean, a lower bound on the mean time.
An arm stopped by the cap before it spent the budget (``ended_under_budget``) is ``capped``:
it did not fail to reach the threshold within the budget, it stopped looking; its censored
time is what it spent and its eval at the budget is the eval at its last step, both marked.
"Held": from its first crossing to the budget (or a capped arm's last step) no eval of the
curve falls below the threshold. The arms' start and end times (``arms.jsonl``) are checked for
overlap; the runs the race's ``config.json`` expects and that have no ``done.json`` are listed.
Try folders (``<arm>_s<seed>.try<k>``, kept by the runner) are not read.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_presets import mean_ci  # noqa: E402
from vs_trl_arms import ARMS, PHASES, REFERENCE, ended_under_budget, read_rows  # noqa: E402
from vs_trl_tables import BEGIN, END, PAIRS, plot, render, replace_section, verdict  # noqa: E402

__all__ = ["BEGIN", "END", "PAIRS", "plot", "render", "replace_section", "summarize", "verdict"]

RUN_NAME = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)$")  # not <arm>_s<seed>.try<k>


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


def held(points: List[dict], threshold: float, end: float) -> Optional[bool]:
    """From the first eval at or above ``threshold`` up to ``end`` CPU seconds, every eval is at
    or above it and so is the curve at ``end``; None if no eval reaches it by ``end``."""
    first = next((i for i, p in enumerate(points) if p["eval"] >= threshold), None)
    if first is None or points[first]["cpu"] > end:
        return None
    after = [p["eval"] for p in points[first:] if p["cpu"] <= end]
    at_end = value_at(points, end)
    return all(v >= threshold for v in after) and (at_end is None or at_end >= threshold)


def wall_at(steps: List[dict], cpu: float) -> float:
    """The training wall seconds when the steps' summed CPU seconds reach ``cpu``, linear
    within the step that reaches it; all the steps' wall seconds if none does."""
    c = w = 0.0
    for r in steps:
        if c + r["cpu_s"] >= cpu:
            return w + (cpu - c) / r["cpu_s"] * r["wall_s"] if r["cpu_s"] else w
        c, w = c + r["cpu_s"], w + r["wall_s"]
    return w


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
    settings = {}
    if (d / "settings.json").is_file():  # one indented JSON object
        settings = json.loads((d / "settings.json").read_text())
    points = curve(steps, read_rows(d / "eval.jsonl"))
    cpu = sum(r["cpu_s"] for r in steps)
    capped = ended_under_budget(budget, cpu)
    split = {k: _mean([r["split"][k][1] for r in steps]) for k in PHASES}
    skipped = [r["cpu_s"] for r in steps if r.get("skipped")]
    ttt_cpu = ttt_wall = censored_cpu = censored_wall = holds = None
    if threshold is not None:
        ttt_cpu = crossing(points, threshold, "cpu")
        if ttt_cpu is not None and budget is not None and ttt_cpu > budget * (1 + 1e-9):
            ttt_cpu = None  # reached only after the budget: not within it
        ttt_wall = None if ttt_cpu is None else crossing(points, threshold, "wall")
        end = cpu if capped or budget is None else budget
        censored_cpu = end if ttt_cpu is None else ttt_cpu
        censored_wall = wall_at(steps, end) if ttt_wall is None else ttt_wall
        holds = None if ttt_cpu is None else held(points, threshold, end)
    return {
        "steps": len(steps),
        "stopped": done["stopped"],
        "capped": capped,
        "cpu_s": cpu,
        "cpu_per_step": _mean([r["cpu_s"] for r in steps]),
        "wall_per_step": _mean([r["wall_s"] for r in steps]),
        "split_cpu": split,
        "update_tokens_per_step": _mean([r.get("update_tokens") for r in steps]),
        "skipped": len(skipped),
        "cpu_per_skipped_step": _mean(skipped),
        "cpu_per_updating_step": _mean([r["cpu_s"] for r in steps if not r.get("skipped")]),
        "load1": _mean([r.get("load1") for r in steps]),
        "code": settings.get("code"),  # None: recorded before the runner kept it
        "eval_final": points[-1]["eval"] if points else None,
        "eval_at_budget": None if budget is None else value_at(points, budget),
        "time_to_threshold_cpu": ttt_cpu,
        "time_to_threshold_wall": ttt_wall,
        "time_to_threshold_cpu_censored": censored_cpu,
        "time_to_threshold_wall_censored": censored_wall,
        "held": holds,
        "curve": points,
        "steps_rows": [
            {k: r[k] for k in ("step", "t", "cpu_s", "wall_s", "update_tokens", "load1") if k in r}
            for r in steps
        ],
    }


def expected_runs(config: dict) -> List[tuple]:
    """(arm, seed) of every run the race's ``config.json`` asks for, in ``ARMS`` order."""
    names = set(str(config["arms"]).split(",")) | {REFERENCE}
    first = int(config["first_seed"])
    return [
        (name, seed)
        for seed in range(first, first + int(config["seeds"]))
        for name in ARMS
        if name in names
    ]


def missing_runs(root: Path, config: dict, rows: List[dict]) -> List[dict]:
    """The expected runs without ``done.json``, each with why: ``failed, exit N`` (its last
    ``arms.jsonl`` row), ``started, not finished`` (a folder, no row: running or cut), or
    ``not run yet``."""
    out = []
    for name, seed in expected_runs(config):
        d = root / "runs" / f"{name}_s{seed}"
        if (d / "done.json").is_file():
            continue
        tries = [r for r in rows if r["arm"] == name and int(r["seed"]) == seed]
        if tries and tries[-1]["exit"] != 0:
            state = f"failed, exit {tries[-1]['exit']}"
        elif d.exists():
            state = "started, not finished"
        else:
            state = "not run yet"
        out.append({"arm": name, "seed": seed, "state": state})
    return out


def summarize(root: Path, threshold_evals: int = 2) -> dict:
    config = json.loads((root / "config.json").read_text())
    finished: Dict[str, Dict[int, Path]] = {}
    for d in sorted((root / "runs").glob("*_s*")):
        m = RUN_NAME.match(d.name)
        if m and m["arm"] in ARMS and (d / "done.json").is_file():
            finished.setdefault(m["arm"], {})[int(m["seed"])] = d
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
        arms[name] = {"what": ARMS[name].what, "per_seed": per_seed, **_aggregate(per_seed)}
    rows = read_rows(root / "arms.jsonl")
    loads = [r["load1"] for r in read_rows(root / "load.jsonl")]
    # folders set aside (``<arm>_s<seed>.<why>``: a cut or failed try, or a finished run
    # replaced by a rerun), named so that the report discloses what it does not read
    aside = [
        {"run": d.name, "finished": (d / "done.json").is_file()}
        for d in sorted((root / "runs").glob("*_s*.*"))
        if d.is_dir() and not RUN_NAME.match(d.name)
    ]
    ref = arms[REFERENCE]
    summary = {
        "config": config,
        "threshold_evals": threshold_evals,
        "seeds": seeds,
        "arms": arms,
        "arm_runs": rows,
        "overlaps": overlaps(rows),
        "expected_runs": len(expected_runs(config)),
        "missing": missing_runs(root, config, rows),
        "set_aside": aside,
        "load": {"samples": len(loads), "mean": _mean(loads), "max": max(loads, default=None)},
        "reference_split": {
            k: _mean([r["split_cpu"][k] for r in ref["per_seed"].values()]) for k in PHASES
        },
    }
    if (root / "compaction.json").is_file():
        summary["compaction"] = _compaction(json.loads((root / "compaction.json").read_text()))
    return summary


def _aggregate(per_seed: Dict[int, dict]) -> dict:
    runs = list(per_seed.values())

    def of(key, when=lambda r: True):
        return mean_ci([r[key] for r in runs if when(r) and r[key] is not None])

    return {
        "runs": len(runs),
        "reached": sum(r["time_to_threshold_cpu"] is not None for r in runs),
        "held": sum(bool(r["held"]) for r in runs),
        "capped": sum(r["capped"] for r in runs),
        "skipped": sum(r["skipped"] for r in runs),
        "step_count": sum(r["steps"] for r in runs),
        "steps": of("steps"),
        "cpu_per_step": of("cpu_per_step"),
        "wall_per_step": of("wall_per_step"),
        "update_tokens_per_step": of("update_tokens_per_step"),
        "load1": of("load1"),
        # a capped seed has no eval at the budget: the eval at its last step stands in (marked)
        "eval_at_budget": mean_ci(
            [r["eval_final"] if r["capped"] else r["eval_at_budget"] for r in runs]
        ),
        # the main reading: a seed that did not reach it counts what it spent (a lower bound)
        "time_to_threshold_cpu_censored": of("time_to_threshold_cpu_censored"),
        "time_to_threshold_wall_censored": of("time_to_threshold_wall_censored"),
        # the seeds that reached it only
        "time_to_threshold_cpu": of("time_to_threshold_cpu"),
        "time_to_threshold_wall": of("time_to_threshold_wall"),
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
