"""``DIR/train.log``: the run's own log, with every line the terminal showed and every step's
summary line, whatever the progress bar does.

What it holds: every record that reaches the root logger at the run's level
(``logging.level`` for the ``nemo_d3s`` loggers, warnings of the libraries), in Hydra's
format (``[time][logger][LEVEL] - message``), plus the lines the progress bar stands in for on
the terminal (each step's summary line, written here through :func:`file_only`, never to the
terminal). The trainer writes it, not Hydra's job logging (``conf/hydra/job_logging/
console.yaml`` keeps Hydra's to the terminal): it is then in ``output_dir`` in every mode
(a plain run, a multirun sweep that sets ``output_dir`` or not, a script that calls
``trainer.loop.train``), and torchrun's ranks do not interleave lines in one file.

Ranks: rank 0 writes ``train.log``; rank r > 0 writes its warnings and errors to
``train.rank<r>.log``, created only when it has one. Lines are appended: a resumed run
continues the file. Records made before the run has taken its folder (the model load) are
held in memory (at most :data:`EARLY_RECORDS`) and written once it has, so a run that
refuses the folder (another run's records) writes nothing into it.
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
    """Without a RunLog, a warning that no handler takes goes to stderr (Python's
    ``logging.lastResort``: a script that calls ``train`` without configuring logging); a
    RunLog on the root logger must not silence it. The first RunLog passes it on."""
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
