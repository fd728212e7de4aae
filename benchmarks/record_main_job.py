"""The main job's record: what `python -m nemo_d3s.train` costs on this machine, as JSON.

    python benchmarks/record_main_job.py run \\
        --out benchmarks/results/cpu_default/main_job.json [-- overrides]
    python benchmarks/record_main_job.py summarize RUN_DIR --out FILE

``run`` trains the main job (the CPU default plus any Hydra overrides after ``--``) in a child
process and records, besides what ``summarize`` reads, the child's peak resident memory
(``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the largest RSS of any finished child, here the
trainer) and the disk the run left (total, one checkpoint, the Hugging Face export).
``summarize`` reads an existing run folder (``metrics.jsonl``, ``eval.jsonl``,
``summary.json``, ``config.yaml``): seconds per step (median and range; a step is rollout +
reward + log-prob pass + update, evaluation excluded), where a step's time goes, the
evaluation curve, the training time and the evaluations' time. The README's and docs'
figures for the main job are read from these records by ``tests/test_doc_numbers.py``.

Both write ``machine`` (CPU model, cores, torch) beside the numbers: s/step depends on the
machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchlib import machine_info  # noqa: E402

REPO = HERE.parent


def _rows(path: Path) -> List[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.is_file()
        else []
    )


def _du(path: Path) -> int:
    return (
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        if path.exists()
        else 0
    )


def summarize(run_dir: Path) -> dict:
    """The record of a finished run folder (no memory: that needs ``run``)."""
    steps = [r for r in _rows(run_dir / "metrics.jsonl") if "time_step" in r]
    evals = _rows(run_dir / "eval.jsonl")
    if not steps:
        raise SystemExit(f"error: {run_dir}/metrics.jsonl has no steps")
    t = [float(r["time_step"]) for r in steps]
    total = sum(t)

    def share(key: str) -> float:
        return round(sum(float(r.get(key, 0.0)) for r in steps) / total, 3)

    summary = (
        json.loads((run_dir / "summary.json").read_text())
        if (run_dir / "summary.json").is_file()
        else {}
    )
    return {
        "steps": len(steps),
        "s_per_step": {
            "median": round(statistics.median(t), 2),
            "min": round(min(t), 2),
            "max": round(max(t), 2),
            "mean": round(total / len(t), 2),
        },
        "step_time_share": {
            "rollout": share("time_rollout"),
            "logprob": share("time_logprob"),
            "update": share("time_update"),
        },
        "train_seconds": round(total, 1),
        "eval_seconds": round(sum(float(e.get("time_eval", 0.0)) for e in evals), 1),
        "wall_seconds_in_summary": summary.get("wall_time"),
        "eval": [
            {"step": e["step"], "reward": e["eval_reward_mean"], "n": e.get("eval_n")}
            for e in evals
        ],
        "update_tokens_total": summary.get("update_tokens_total"),
        "rollout_tokens_total": summary.get("rollout_tokens_total"),
    }


def run(out_dir: Path, overrides: Sequence[str]) -> dict:
    """Train in a child process and add peak RSS, wall clock and disk to its summary."""
    cmd = [
        sys.executable,
        "-m",
        "nemo_d3s.train",
        *overrides,
        f"output_dir={out_dir}",
        "logging.progress_bar=false",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: the run failed (exit {proc.returncode}): {' '.join(cmd)}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    ckpts = sorted((out_dir / "checkpoints").glob("step_*"))
    record = summarize(out_dir)
    record.update(
        {
            "command": " ".join(["python -m nemo_d3s.train", *overrides]),
            "wall_seconds": round(wall, 1),
            "peak_rss_bytes": peak_kib * 1024,
            "disk_bytes": {
                "total": _du(out_dir),
                "checkpoints_kept": len(ckpts),
                "one_checkpoint": _du(ckpts[-1]) if ckpts else 0,
                "hf_export": _du(out_dir / "hf_export"),
            },
        }
    )
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="train the main job and record it")
    r.add_argument("--out", required=True, type=Path, help="the JSON record to write")
    r.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where the run writes (default: a folder beside --out, removed afterwards)",
    )
    s = sub.add_parser("summarize", help="record an existing run folder")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--out", required=True, type=Path)
    s.add_argument(
        "--machine", required=True, help="the machine the run ran on, in words (not this one's)"
    )
    args = p.parse_args(argv)
    if args.mode == "run":
        run_dir = args.run_dir or args.out.with_name(args.out.stem + "_run")
        if run_dir.exists():
            raise SystemExit(f"error: {run_dir} exists; remove it or pass another --run-dir")
        record = run(run_dir, extra)
        if args.run_dir is None:
            shutil.rmtree(run_dir)
    else:
        record = {
            "command": f"(records of an earlier run: {args.run_dir})",
            **summarize(args.run_dir),
            "machine": {"described": args.machine},
        }
    if args.mode == "run":
        record["machine"] = {
            k: v for k, v in machine_info().items() if k not in ("argv", "git", "date_utc")
        }
        record["machine"]["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("steps", "s_per_step") if k in record}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
