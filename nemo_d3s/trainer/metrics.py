"""Where metrics go: ``metrics.jsonl`` / ``eval.jsonl`` (rank 0), TensorBoard when installed, a
tqdm bar and ``train.log``. Keys starting with ``time_`` or ``wall_`` are timings; the rest are
pure functions of config and seed. On resume the files are cut back to the checkpoint's step.
A record is written whole or not at all; readers skip a line that is not JSON with a warning
(rewriting keeps it in ``<name>.garbled``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from nemo_d3s.files import atomic_write_text
from nemo_d3s.trainer.faults import RunError, fault_point
from nemo_d3s.trainer.runlog import file_only

__all__ = ["MetricsLogger", "read_jsonl", "truncate_jsonl", "is_timing_key", "JsonlAppender"]

log = logging.getLogger("nemo_d3s.trainer")

TIMING_PREFIXES = ("time_", "wall_")
_write = os.write  # one indirection, so a test can fill the disk


def is_timing_key(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES)


def _parse_jsonl(p: Path) -> Tuple[List[Dict[str, Any]], List[Tuple[int, str]]]:
    """(rows, [(line number, raw line)] of lines that are not a JSON object)."""
    rows: List[Dict[str, Any]] = []
    bad: List[Tuple[int, str]] = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append((lineno, line))
    return rows, bad


def read_jsonl(path: str | os.PathLike, *, warn: bool = True) -> List[Dict[str, Any]]:
    """Every JSON-object line of ``path`` ([] when it does not exist). Other lines are
    skipped, with a warning naming their line numbers."""
    p = Path(path)
    if not p.is_file():
        return []
    rows, bad = _parse_jsonl(p)
    if bad and warn:
        log.warning(
            "%s: skipped %d line(s) that are not valid JSON: line %s",
            p,
            len(bad),
            ", ".join(str(n) for n, _ in bad[:10]) + (" ..." if len(bad) > 10 else ""),
        )
    return rows


def truncate_jsonl(path: str | os.PathLike, max_step: int) -> None:
    """Keep rows with ``step <= max_step`` (rewritten atomically). Garbled lines are
    appended to ``<name>.garbled`` (with their line numbers), never silently lost."""
    p = Path(path)
    if not p.is_file():
        return
    rows, bad = _parse_jsonl(p)
    if bad:
        with (p.parent / (p.name + ".garbled")).open("a", encoding="utf-8") as g:
            for n, line in bad:
                g.write(f"{n}\t{line}\n")
        log.warning(
            "%s: %d line(s) are not valid JSON (line %s); kept the %d good rows, moved "
            "those lines to %s",
            p,
            len(bad),
            ", ".join(str(n) for n, _ in bad[:10]),
            len(rows),
            p.name + ".garbled",
        )
    rows = [r for r in rows if _step_of(r) <= max_step]
    atomic_write_text(p, "".join(json.dumps(r) + "\n" for r in rows))


def _step_of(row: Dict[str, Any]) -> int:
    try:
        return int(row.get("step", 0))
    except (TypeError, ValueError):
        return 0


class JsonlAppender:
    """Appends whole lines to a JSONL file (one ``os.write`` per record, O_APPEND); a failed write
    is cut back and raised as a RunError naming the file. A partial last line found on open is
    moved to ``<name>.garbled``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        _repair_tail(self.path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        end = os.fstat(self.fd).st_size
        try:
            fault_point("metrics.write")
            n = _write(self.fd, data)
            if n != len(data):  # a short write: the disk filled up part-way
                raise OSError(28, f"short write ({n} of {len(data)} bytes)")
        except OSError as e:
            try:
                os.ftruncate(self.fd, end)
            except OSError:
                pass
            raise RunError(
                f"could not write {str(self.path)!r}: {e.strerror or e}; the file keeps its whole "
                "lines, resume=true continues from the last checkpoint"
            ) from None

    def sync(self) -> None:
        """Flush the lines written so far to the disk."""
        if self.fd is not None:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _repair_tail(p: Path) -> None:
    """Cut a last line that has no newline (a write interrupted by a crash) into
    ``<name>.garbled``; the file then ends with a whole line again."""
    if not p.is_file():
        return
    size = p.stat().st_size
    if size == 0:
        return
    with p.open("rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        chunk = min(size, 1 << 20)
        f.seek(size - chunk)
        tail = f.read(chunk)
        cut = size - chunk + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        f.seek(cut)
        partial = f.read()
        with (p.parent / (p.name + ".garbled")).open("ab") as g:
            g.write(b"(partial last line)\t" + partial + b"\n")
        f.truncate(cut)
    log.warning(
        "%s ended in a partial line (an interrupted write); moved it to %s", p, p.name + ".garbled"
    )


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf; null keeps the row parseable by any reader.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Writes step and eval rows; a no-op on ranks other than 0."""

    def __init__(
        self,
        output_dir: str,
        *,
        enabled: bool,
        tensorboard: bool,
        progress_bar: bool,
        total_steps: int,
        start_step: int,
    ) -> None:
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.tb = None
        self.bar = None
        self._eval_bar = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics = JsonlAppender(self.dir / "metrics.jsonl")
        self._eval = JsonlAppender(self.dir / "eval.jsonl")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:  # tensorboard is an optional extra
                log.info("tensorboard not installed; writing JSONL only")
        if progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def log_step(self, row: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps({k: _clean(v) for k, v in row.items()}))
        self._scalars("train", row)
        line = "step {}: reward={:.3f} smp={:.2f} tok={:.2f} time={:.1f} s".format(
            row.get("step"),
            row.get("reward_mean", float("nan")),
            row.get("kept_sample_ratio", float("nan")),
            row.get("kept_token_ratio", float("nan")),
            row.get("time_step", float("nan")),
        )
        if "time_generation" in row:  # the two budgets: rollouts generated, rollouts trained
            line += " (generated {:.0f} in {:.1f} s, trained {:.0f} in {:.1f} s)".format(
                row.get("n_samples", float("nan")),
                row["time_generation"],
                row.get("n_kept_samples", 0.0),
                row.get("time_training", float("nan")),
            )
        if self.bar is not None:  # the bar shows the step on the terminal, train.log its line
            self.bar.update(1)
            self.bar.set_postfix(
                reward=f"{row.get('reward_mean', float('nan')):.3f}",
                smp=f"{row.get('kept_sample_ratio', float('nan')):.2f}",
                tok=f"{row.get('kept_token_ratio', float('nan')):.2f}",
                refresh=False,
            )
            file_only(log, line)
        else:  # a log file (Slurm): the bar's fields and the step's time, one line per step
            log.info(line)

    def sync(self) -> None:
        """The rows so far on the disk: before a checkpoint is published, as a resume
        continues after its step and never writes the rows up to it again."""
        if self.enabled:
            self._metrics.sync()
            self._eval.sync()

    def log_eval(self, row: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._eval.write(json.dumps({k: _clean(v) for k, v in row.items()}))
        self._scalars("eval", row)
        self.close_eval_progress()
        self.write(
            f"eval step {row['step']}: reward {row['eval_reward_mean']:.4f} over "
            f"{row['eval_n']} problems in {row.get('time_eval', float('nan')):.1f} s"
        )

    def eval_progress(self, done: int, total: int) -> None:
        """Evaluation batches done of ``total`` (rank 0): a second bar while the bar is on."""
        if self.bar is None:
            return
        if self._eval_bar is None:
            from tqdm.auto import tqdm

            self._eval_bar = tqdm(
                total=total, desc="eval", unit="batch", leave=False, dynamic_ncols=True
            )
        self._eval_bar.update(done - self._eval_bar.n)

    def close_eval_progress(self) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def _scalars(self, prefix: str, row: Dict[str, Any]) -> None:
        if self.tb is None:
            return
        step = int(row.get("step", 0))
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(f"{prefix}/{k}", v, step)

    @contextlib.contextmanager
    def clock_paused(self) -> Iterator[None]:
        """Stop the bar's clock while the block runs, so its rate and ETA count training only."""
        t0 = time.time()  # tqdm's clock (tqdm/std.py: ``self._time = time``)
        try:
            yield
        finally:
            if self.bar is not None:
                paused = time.time() - t0
                self.bar.start_t += paused
                self.bar.last_print_t += paused  # the next step's rate sample, not the pause

    def write(self, msg: str) -> None:
        """A line that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
            file_only(log, msg)
        else:
            log.info(msg)

    def close(self) -> None:
        if not self.enabled:
            return
        self.close_eval_progress()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self._metrics.close()
        self._eval.close()
