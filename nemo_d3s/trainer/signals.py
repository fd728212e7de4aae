"""Stop signals: SIGTERM, SIGUSR1 or a first Ctrl-C stop the run after the current step (or
evaluation batch) at a checkpoint; a second stops at once (:class:`StopNow`, exit 128 +
signal). ``STOPPING`` records signals received, so ``train.py``'s handler ignores a later
signal once a run has checkpointed on one.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable, Dict, List, Optional

__all__ = ["STOP_SIGNALS", "STOPPING", "StopNow", "StopSignals"]

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
STOPPING: List[str] = []


class StopNow(SystemExit):
    """The second stop signal: exit at once (128 + signal); never taken for a reward
    function's own ``sys.exit`` (``tasks_adapter``)."""


class StopSignals:
    """``name``: the first stop signal (None: none yet). ``install`` / ``restore`` the handlers;
    ``on_first``: called on the first signal.
    """

    def __init__(self, on_first: Optional[Callable[[], None]] = None) -> None:
        self.name: Optional[str] = None
        self._previous: Dict[int, Any] = {}
        self.on_first = on_first
        self.saved = False  # the stop's checkpoint is written: later signals change nothing

    @property
    def requested(self) -> bool:
        return self.name is not None

    def _handler(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.saved:
            print(f"{name}: already stopping; the checkpoint is written", file=sys.stderr)
            return
        if self.name is not None:
            print(
                f"second {name}: stopping now, without a checkpoint "
                "(resume=true continues from the last one)",
                file=sys.stderr,
                flush=True,
            )
            raise StopNow(128 + signum)
        self.name = name
        STOPPING.append(name)
        if signum == getattr(signal, "SIGINT", None):
            print(
                "SIGINT: finishing the current step, then writing a checkpoint "
                "(press Ctrl-C again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        if self.on_first is not None:
            self.on_first()

    def install(self) -> None:
        STOPPING.clear()  # an earlier run of this process (in-process callers) is not this one
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
