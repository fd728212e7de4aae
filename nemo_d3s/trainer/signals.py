"""Stop signals of a run: SIGTERM, SIGUSR1 or a first Ctrl-C (SIGINT) ask the run to stop
after the current step (or evaluation batch), at a checkpoint; a second signal stops at once
(exit 128 + signal, without a checkpoint)."""

from __future__ import annotations

import signal
import sys
from typing import Any, Dict, Optional

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class StopSignals:
    """``name``: the first stop signal received (None: none yet). :meth:`install` sets the
    handlers for the run; :meth:`restore` puts the previous ones back when it ends."""

    def __init__(self) -> None:
        self.name: Optional[str] = None
        self._previous: Dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.name is not None

    def _handler(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.name is not None:
            print(
                f"second {name}: stopping now, without a checkpoint "
                "(resume=true continues from the last one)",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + signum)
        self.name = name
        if signum == getattr(signal, "SIGINT", None):
            print(
                "SIGINT: finishing the current step, then writing a checkpoint "
                "(press Ctrl-C again to stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def install(self) -> None:
        for name in STOP_SIGNALS:
            if hasattr(signal, name):
                sig = getattr(signal, name)
                try:
                    self._previous[sig] = signal.signal(sig, self._handler)
                except ValueError:  # not the main thread (e.g. inside a notebook worker)
                    pass

    def restore(self) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)
        self._previous = {}
