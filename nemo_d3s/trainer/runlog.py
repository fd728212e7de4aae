"""``DIR/train.log``: every record the root logger takes at the run's level plus each step's
summary line (:func:`file_only`), written by the trainer (not Hydra) so it is in
``output_dir`` in every mode. Rank 0 writes ``train.log``; rank r > 0 its warnings to
``train.rank<r>.log``. Appended on resume. Records made before the folder is taken are held
in memory (:data:`EARLY_RECORDS`), so a run that refuses the folder writes nothing into it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional

__all__ = ["EARLY_RECORDS", "FORMAT", "RunLog", "file_only"]

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's default job format
EARLY_RECORDS = 10_000  # records kept from before the folder is taken; later ones are dropped


class RunLog(logging.Handler):
    """A handler on the root logger: buffers until :meth:`open`, then appends to the file.
    ``close`` (idempotent) removes it from the root logger."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))
        self._early: Optional[List[logging.LogRecord]] = []
        self._file: Optional[logging.FileHandler] = None
        logging.getLogger().addHandler(self)

    def open(self, out: Path, *, rank: int) -> Path:
        """Start writing ``out/train.log`` (rank 0) or ``out/train.rank<r>.log`` (warnings
        only); the records held so far go first."""
        if rank == 0:
            path = out / "train.log"
        else:
            path = out / f"train.rank{rank}.log"
            self.setLevel(logging.WARNING)
        self._file = logging.FileHandler(path, mode="a", encoding="utf-8", delay=rank != 0)
        self._file.setFormatter(self.formatter)
        early, self._early = self._early or [], None
        for record in early:
            if record.levelno >= self.level:
                self._file.handle(record)
        return path

    def emit(self, record: logging.LogRecord) -> None:
        if _needs_last_resort(self, record):
            logging.lastResort.handle(record)
        if self._file is not None:
            self._file.handle(record)
        elif self._early is not None and len(self._early) < EARLY_RECORDS:
            self._early.append(record)

    def close(self) -> None:
        logging.getLogger().removeHandler(self)
        if self._file is not None:
            self._file.close()
            self._file = None
        self._early = None
        super().close()


def _needs_last_resort(handler: RunLog, record: logging.LogRecord) -> bool:
    """Whether to pass on to ``logging.lastResort``: a RunLog must not silence an unhandled
    warning of a script that configured no logging. Only the first RunLog does.
    """
    last = logging.lastResort
    if last is None or record.levelno < last.level or getattr(record, "run_log_only", False):
        return False
    lg: Optional[logging.Logger] = logging.getLogger(record.name)
    while lg is not None:
        if any(not isinstance(h, RunLog) for h in lg.handlers):
            return False
        lg = lg.parent if lg.propagate else None
    first = next(h for h in logging.getLogger().handlers if isinstance(h, RunLog))
    return first is handler


def file_only(logger: logging.Logger, msg: str, level: int = logging.INFO) -> None:
    """``msg`` to the run's log file only: the line the progress bar shows on the terminal
    instead (every open :class:`RunLog` on the root logger gets it; none: nothing)."""
    if not logger.isEnabledFor(level):
        return
    record = logger.makeRecord(logger.name, level, "(run log)", 0, msg, (), None)
    record.run_log_only = True
    for h in logging.getLogger().handlers:
        if isinstance(h, RunLog) and record.levelno >= h.level:
            h.handle(record)
