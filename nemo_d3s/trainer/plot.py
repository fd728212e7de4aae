"""``nemo-d3s-plot RUN_DIR [RUN_DIR ...] -o reward.png``: reward curves of one or more runs.

Reward vs step, vs cumulative update tokens and vs wall time, one line per run; training
reward solid (smoothed), evaluation reward (``eval.jsonl``) with markers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from nemo_d3s.trainer.metrics import read_jsonl

__all__ = ["main", "plot_runs"]

_AXES = (
    ("step", "step"),
    ("update_tokens_total", "loss-carrying update tokens (cumulative)"),
    ("wall_time", "wall time (s)"),
)


def _smooth(values: List[float], window: int) -> List[float]:
    if window <= 1:
        return values
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _eval_x(evals: List[dict], steps: List[dict], key: str) -> List[float]:
    """x of each eval row: eval rows only carry ``step``; map it through the step rows."""
    by_step: Dict[int, float] = {0: 0.0}
    for r in steps:
        if isinstance(r.get(key), (int, float)):
            by_step[int(r["step"])] = float(r[key])
    return [by_step.get(int(e["step"]), float("nan")) for e in evals]


def plot_runs(
    run_dirs: Sequence[str],
    output: str,
    labels: Optional[Sequence[str]] = None,
    smooth: int = 5,
    title: Optional[str] = None,
) -> str:
    """Draw the three panels for ``run_dirs`` into ``output`` (PNG). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run directories")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), squeeze=False)
    plotted = 0
    for i, d in enumerate(run_dirs):
        path = Path(d)
        steps = read_jsonl(path / "metrics.jsonl")
        evals = read_jsonl(path / "eval.jsonl")
        if not steps and not evals:
            print(
                f"warning: {path} has no metrics.jsonl / eval.jsonl rows; skipped", file=sys.stderr
            )
            continue
        label = labels[i] if labels else (path.name or str(path))
        color = f"C{plotted % 10}"
        for ax, (key, _) in zip(axes[0], _AXES):
            rows = [
                r
                for r in steps
                if isinstance(r.get(key), (int, float))
                and isinstance(r.get("reward_mean"), (int, float))
            ]
            if rows:
                ax.plot(
                    [r[key] for r in rows],
                    _smooth([r["reward_mean"] for r in rows], smooth),
                    color=color,
                    label=f"{label} (train)",
                )
            if evals:
                ax.plot(
                    _eval_x(evals, steps, key),
                    [e["eval_reward_mean"] for e in evals],
                    color=color,
                    marker="o",
                    linestyle="--",
                    label=f"{label} (eval)",
                )
        plotted += 1
    if plotted == 0:
        raise ValueError("none of the run directories has metrics to plot")
    for ax, (_, xlabel) in zip(axes[0], _AXES):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or f"reward (train smoothed over {smooth} steps; eval greedy)")
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="nemo-d3s-plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl / eval.jsonl)")
    p.add_argument(
        "-o", "--output", "--out", default="reward.png", help="PNG to write (default reward.png)"
    )
    p.add_argument("--label", action="append", help="legend label per run (repeat, in order)")
    p.add_argument("--smooth", type=int, default=5, help="moving-average window for train reward")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    try:
        out = plot_runs(a.runs, a.output, a.label, a.smooth, a.title)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(out)


if __name__ == "__main__":
    main()
