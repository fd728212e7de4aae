"""Stop signals: SIGTERM, SIGUSR1 or a first Ctrl-C stop the run after the current step (or
evaluation batch) at a checkpoint; a second stops at once (:class:`StopNow`, exit 128 +
signal). ``STOPPING`` records signals received, so ``train.py``'s handler ignores a later
signal once a run has checkpointed on one. From the process's start until the loop installs
its handlers (model build, engine start, checkpoint load), :class:`StartupStops` records
them, and the loop's :meth:`StopSignals.install` carries the first one over.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

__all__ = [
    "STOP_SIGNALS",
    "STOPPING",
    "StartupStops",
    "StopNow",
    "StopSignals",
    "children_ignore_as_started",
]

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
        early = None
        for sig in _signals():
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. inside a notebook worker)
                continue
            # taken only once this handler is in place: a signal in between is recorded by
            # one or the other, never handed to what StartupStops does after the start-up
            if isinstance(self._previous[sig], StartupStops):
                early = self._previous[sig].take() or early
        if early is not None and self.name is None:
            self.name = early
            STOPPING.append(early)
            if self.on_first is not None:
                self.on_first()

    def restore(self) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)
        self._previous = {}


def _signals() -> List[int]:
    return [getattr(signal, n) for n in STOP_SIGNALS if hasattr(signal, n)]


class StartupStops:
    """The stop signals' handler from the process's start (``train.py``) until a run's
    :meth:`StopSignals.install` takes the first one over: the run then stops at its first safe
    point (the loop's stop checks: a checkpoint of the step it starts at, exit 75).
    Without it a job's SIGUSR1 in a start-up of many minutes was ignored (sbatch's trap) or
    ended the process, and the run trained on into the time limit's SIGKILL. A second signal
    stops at once (:class:`StopNow`), as during a step: nothing is lost yet, and whoever
    sends two wants it over now. After the start-up (the loop's ``restore``) a signal the
    process was started ignoring is ignored again, the others go to ``after``.
    """

    def __init__(self, after: Callable[[int, Any], None], started: Dict[int, Any]) -> None:
        self.after = after
        self.started = started  # each signal's disposition when the process started
        self.name: Optional[str] = None
        self.taken = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.taken:
            if self.started.get(signum) is signal.SIG_IGN:
                return
            return self.after(signum, frame)
        name = signal.Signals(signum).name
        if self.name is not None:
            print(f"second {name} during start-up: stopping now", file=sys.stderr, flush=True)
            raise StopNow(128 + signum)
        self.name = name
        print(
            f"{name} during start-up: the run stops at a checkpoint once it has started "
            "(a second stop signal stops it at once)",
            file=sys.stderr,
            flush=True,
        )

    def take(self) -> Optional[str]:
        """The first signal of the start-up (None: none); signals go to ``after`` from now."""
        self.taken = True
        return self.name

    @classmethod
    def arm(cls, after: Callable[[int, Any], None]) -> "StartupStops":
        """Install it for every stop signal, unless one not yet taken over is (``main`` arms
        it before Hydra, ``_run`` again); one taken over passes on what the process started
        with. From the main thread only (``signal.signal``)."""
        current = {sig: signal.getsignal(sig) for sig in _signals()}
        armed = [h for h in current.values() if isinstance(h, cls)]
        if armed and not armed[0].taken:
            return armed[0]
        started = dict(armed[0].started) if armed else current
        handler = cls(after, started)
        for sig in current:
            signal.signal(sig, handler)
        return handler


@contextlib.contextmanager
def children_ignore_as_started() -> Iterator[None]:
    """While the rollout engine starts its processes (``multiprocessing``'s spawn): each spawn
    runs with the stop signals the process was started ignoring (sbatch's trap) ignored again,
    so the new processes inherit that as they did before :class:`StartupStops`; a caught signal
    is the default action in a new program, and the job's SIGUSR1 would end a vLLM engine
    (vLLM handles SIGTERM and SIGINT only) that the stop path expects awake (trainer/step.py).
    A signal in the instant of a spawn is lost, as before for the whole start-up.
    """
    import multiprocessing.util as mp_util

    armed = [h for h in map(signal.getsignal, _signals()) if isinstance(h, StartupStops)]
    ignored = [s for s, h in armed[0].started.items() if h is signal.SIG_IGN] if armed else []
    if not ignored:
        yield
        return
    real = mp_util.spawnv_passfds

    def spawn(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return real(*args, **kwargs)  # signal.signal: the main thread's only
        held = {s: signal.signal(s, signal.SIG_IGN) for s in ignored}
        try:
            return real(*args, **kwargs)
        finally:
            for s, h in held.items():
                signal.signal(s, h)

    mp_util.spawnv_passfds = spawn
    try:
        yield
    finally:
        mp_util.spawnv_passfds = real
