"""Named fault-injection points for the tests; a leaf every layer may import.

``NEMO_D3S_FAULT=<point>[@<n>][=<action>][,...]`` acts the n-th time (default 1) the process
passes :func:`fault_point` ``<point>``. Actions: ``kill`` (default), ``stop`` (SIGSTOP; pid
appended to ``$NEMO_D3S_FAULT_PIDFILE``), ``term``, ``termgroup`` (SIGTERM to the process group,
as a scheduler's pre-emption, then 3 s), ``termtree`` (SIGTERM to itself and its children, its
engine among them, then 3 s), ``termgroup_in<seconds>`` (termgroup's signal from a thread that
much later, mid-call), ``enospc``, ``sleep<seconds>``. ``NEMO_D3S_FAULT_RANK=<r>`` limits them
to ``RANK`` r. Unset, a point costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import threading
import time
from typing import Dict, Tuple

__all__ = ["fault_point", "reset_fault_points"]

_ENV = "NEMO_D3S_FAULT"
_hits: Dict[str, int] = {}


def _specs() -> Dict[str, Tuple[int, str]]:
    raw = os.environ.get(_ENV, "")
    out: Dict[str, Tuple[int, str]] = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        spec, _, action = part.partition("=")
        name, _, nth = spec.partition("@")
        out[name] = (int(nth) if nth else 1, action or "kill")
    return out


def reset_fault_points() -> None:
    """Forget how often each point was passed (a process that runs several runs)."""
    _hits.clear()


def _term_group() -> None:
    os.killpg(os.getpgid(0), signal.SIGTERM)


def fault_point(name: str) -> None:
    """A place where a test may inject a fault (see the module docstring)."""
    if _ENV not in os.environ:
        return
    spec = _specs().get(name)
    if spec is None:
        return
    only = os.environ.get("NEMO_D3S_FAULT_RANK")
    if only is not None and os.environ.get("RANK", "0") != only:
        return
    _hits[name] = _hits.get(name, 0) + 1
    nth, action = spec
    if _hits[name] != nth:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered asynchronously
    elif action == "stop":
        pidfile = os.environ.get("NEMO_D3S_FAULT_PIDFILE")
        if pidfile:
            with open(pidfile, "a") as f:
                f.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the handler before the next bytecode
    elif action == "termgroup":
        _term_group()
        time.sleep(3)
    elif action == "termtree":
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3)
    elif action.startswith("termgroup_in"):
        timer = threading.Timer(float(action[len("termgroup_in") :]), _term_group)
        timer.daemon = True
        timer.start()
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif action.startswith("sleep"):
        time.sleep(float(action[5:] or 1))
    else:
        raise ValueError(f"{_ENV}: unknown action {action!r} for point {name!r}")
