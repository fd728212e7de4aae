"""Where metrics go: JSONL files (always), TensorBoard (when installed), a tqdm bar.

Only rank 0 writes. ``metrics.jsonl`` gets one JSON object per step, ``eval.jsonl`` one
per evaluation. Keys starting with ``time_`` or ``wall_`` are timings; everything else is
a pure function of the config and seed (the resume test compares those).

On resume the files are cut back to the checkpoint's step, so rows of steps that were run
after the last checkpoint (and will be run again) do not appear twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["MetricsLogger", "read_jsonl", "truncate_jsonl", "is_timing_key"]

log = logging.getLogger("nemo_d3s.trainer")

TIMING_PREFIXES = ("time_", "wall_")


def is_timing_key(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


def read_jsonl(path: str | os.PathLike) -> List[Dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    with p.open() as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut by a kill: everything before it is good
    return rows


def truncate_jsonl(path: str | os.PathLike, max_step: int) -> None:
    """Keep rows with ``step <= max_step`` (rewritten atomically)."""
    p = Path(path)
    if not p.is_file():
        return
    rows = [r for r in read_jsonl(p) if int(r.get("step", 0)) <= max_step]
    tmp = p.with_suffix(p.suffix + ".tmp")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, p)


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf; null keeps the row parseable by any reader.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Writes step and eval rows; a no-op on ranks other than 0."""

    def __init__(self, output_dir: str, *, enabled: bool, tensorboard: bool, progress_bar: bool,
                 total_steps: int, start_step: int) -> None:
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.tb = None
        self.bar = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics = (self.dir / "metrics.jsonl").open("a")
        self._eval = (self.dir / "eval.jsonl").open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:  # tensorboard is an optional extra
                log.info("tensorboard not installed; writing JSONL only")
        if progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log_step(self, row: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._metrics.flush()
        self._scalars("train", row)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                reward=f"{row.get('reward_mean', float('nan')):.3f}",
                smp=f"{row.get('kept_sample_ratio', float('nan')):.2f}",
                tok=f"{row.get('kept_token_ratio', float('nan')):.2f}",
                refresh=False,
            )

    def log_eval(self, row: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._eval.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._eval.flush()
        self._scalars("eval", row)
        msg = f"eval step {row['step']}: reward {row['eval_reward_mean']:.4f} over {row['eval_n']} problems"
        if self.bar is not None:
            self.bar.write(msg)
        else:
            log.info(msg)

    def _scalars(self, prefix: str, row: Dict[str, Any]) -> None:
        if self.tb is None:
            return
        step = int(row.get("step", 0))
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(f"{prefix}/{k}", v, step)

    def write(self, msg: str) -> None:
        """A line that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            log.info(msg)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self._metrics.close()
        self._eval.close()


def summarize(rows: List[Dict[str, Any]], keys: Optional[List[str]] = None) -> Dict[str, float]:
    """Mean of the given numeric keys over rows (for an end-of-run summary line)."""
    out: Dict[str, float] = {}
    for k in keys or []:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out
