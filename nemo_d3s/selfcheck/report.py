"""The self-check's results: one record per check, how ranks' records combine, the table,
``selfcheck.json`` and the exit code. Rules (:func:`finalize`): a CUDA check is never passed
without CUDA; failed on any rank is failed; not run is not run on every rank; exit 1 when
any check failed.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from nemo_d3s.files import atomic_write_text

__all__ = [
    "CheckFailed",
    "CheckResult",
    "NotRun",
    "PASSED",
    "FAILED",
    "NOT_RUN",
    "NO_CUDA",
    "combine",
    "exit_code",
    "finalize",
    "format_table",
    "run_check",
    "write_json",
]

PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"
NO_CUDA = "no CUDA"


class NotRun(Exception):
    """Raised by a check that cannot run here; the message is the reason."""


class CheckFailed(Exception):
    """Raised by a check whose measurement is out of bounds; ``measured`` is reported."""

    def __init__(self, message: str, measured: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.measured = dict(measured or {})


@dataclass
class CheckResult:
    """One check on one rank: status PASSED, FAILED or NOT_RUN with ``reason``; ``measured`` (JSON
    scalars, short strings); ``seconds`` on this rank; ``rank`` (after :func:`combine`: the
    deciding rank).
    """

    name: str
    needs_cuda: bool
    status: str
    reason: str = ""
    measured: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    rank: int = 0


def _jsonable(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, str):
        return str(v)  # plain str (torch.__version__ is a subclass)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    try:
        return float(v)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(v)


def run_check(
    name: str,
    needs_cuda: bool,
    fn: Callable[[], Optional[Dict[str, Any]]],
    *,
    cuda: bool,
    rank: int = 0,
    what: str = "",
) -> CheckResult:
    """Run one check on this rank: ``fn()``'s numbers pass; NotRun / CheckFailed as raised; any
    other exception fails with its type and message. Without CUDA a CUDA check is not called.
    """
    if needs_cuda and not cuda:
        would = {"would_check": what} if what else {}
        return CheckResult(name, needs_cuda, NOT_RUN, NO_CUDA, would, rank=rank)
    t0 = time.perf_counter()
    try:
        measured = fn() or {}
        status, reason = PASSED, ""
    except NotRun as e:
        measured, status, reason = {}, NOT_RUN, str(e) or "not applicable here"
    except CheckFailed as e:
        measured, status, reason = e.measured, FAILED, str(e)
    except Exception as e:  # a crash is a failure of the path it exercises
        measured, status, reason = {}, FAILED, f"{type(e).__name__}: {e}".strip()
    return CheckResult(
        name, needs_cuda, status, reason, _jsonable(measured), time.perf_counter() - t0, rank
    )


def combine(per_rank: Sequence[Sequence[CheckResult]]) -> List[CheckResult]:
    """Every rank's records (same order) -> one per check: the first failing rank's (reason
    prefixed with its rank), else the first passing rank's, else (not run everywhere) rank 0's.
    """
    if not per_rank:
        return []
    names = [r.name for r in per_rank[0]]
    for rank, records in enumerate(per_rank):
        if [r.name for r in records] != names:
            raise ValueError(
                f"rank {rank} ran other checks than rank 0: {[r.name for r in records]} vs {names}"
            )
    out = []
    for i in range(len(names)):
        column = [records[i] for records in per_rank]
        failed = [r for r in column if r.status == FAILED]
        if failed:
            pick = failed[0]
            reason = pick.reason if len(per_rank) == 1 else f"rank {pick.rank}: {pick.reason}"
            out.append(CheckResult(**{**asdict(pick), "reason": reason}))
        elif any(r.status == PASSED for r in column):
            out.append(next(r for r in column if r.status == PASSED))
        else:
            out.append(column[0])
    return out


def finalize(results: Sequence[CheckResult], *, cuda: bool) -> List[CheckResult]:
    """Apply the no-CUDA rule to the final records (see the module docstring)."""
    out = []
    for r in results:
        if r.needs_cuda and not cuda:  # whatever the record says (but what it would check)
            would = {k: v for k, v in r.measured.items() if k == "would_check"}
            r = CheckResult(r.name, True, NOT_RUN, NO_CUDA, would, r.seconds, r.rank)
        out.append(r)
    return out


def exit_code(results: Sequence[CheckResult]) -> int:
    """1 when any check failed, else 0 (not run is not a failure)."""
    return 1 if any(r.status == FAILED for r in results) else 0


def _numbers(measured: Dict[str, Any], width: int = 90) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    text = ", ".join(f"{k}={fmt(v)}" for k, v in measured.items())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(results: Sequence[CheckResult]) -> str:
    """One line per check: name, status (with the reason), seconds, measured numbers."""
    rows = [("check", "result", "s", "measured")]
    for r in results:
        status = r.status if not r.reason else f"{r.status}: {r.reason}"
        if len(status) > 70:
            status = status[:67] + "..."
        rows.append((r.name, status, f"{r.seconds:.1f}", _numbers(r.measured)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3] for row in rows]
    lines.insert(1, "-" * min(160, max(len(x) for x in lines)))
    counts = {s: sum(r.status == s for r in results) for s in (PASSED, FAILED, NOT_RUN)}
    lines.append(f"{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[NOT_RUN]} not run")
    return "\n".join(lines)


def write_json(
    results: Sequence[CheckResult], out_dir: str | Path, context: Dict[str, Any]
) -> Path:
    """``out_dir/selfcheck.json``: {"context": ..., "exit_code": 0|1, "checks": [records]},
    written to a temporary file and renamed (a reader never sees half of it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "context": _jsonable(context),
        "exit_code": exit_code(results),
        "checks": [asdict(r) for r in results],
    }
    return atomic_write_text(out / "selfcheck.json", json.dumps(doc, indent=2) + "\n")
