"""Faults a run reports to its user, and named fault-injection points for the tests.

``NEMO_D3S_FAULT=<point>[@<n>][=<action>][,...]`` acts the n-th time (default 1) the process
passes :func:`fault_point` ``<point>``. Actions: ``kill`` (default), ``stop`` (SIGSTOP; pid
appended to ``$NEMO_D3S_FAULT_PIDFILE``), ``term``, ``termgroup`` (SIGTERM to the process group,
then 3 s), ``enospc``, ``sleep<seconds>``. ``NEMO_D3S_FAULT_RANK=<r>`` limits them to ``RANK`` r.
Unset, a point costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Any, Callable, Dict, Optional, Tuple

from nemo_d3s.errors import ConfigError, RunError  # RunError re-exported: its home before errors.py

__all__ = ["RunError", "fault_point", "agree_on_main", "first_line"]


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
        os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(3)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif action.startswith("sleep"):
        time.sleep(float(action[5:] or 1))
    else:
        raise ValueError(f"{_ENV}: unknown action {action!r} for point {name!r}")


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (torch's are often pages long)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def agree_on_main(groups: Any, fn: Callable[[], Any], errors: tuple = ()) -> Any:
    """Run ``fn`` on global rank 0 only; when it raises one of ``errors`` (default RunError,
    ConfigError) every rank raises it. Returns ``fn``'s result on rank 0, None elsewhere.
    """
    errors = errors or (RunError, ConfigError)
    result, failure = None, None
    if groups.is_main:
        try:
            result = fn()
        except errors as e:
            failure = (type(e).__name__, str(e))
    failure = broadcast_world(failure)
    if failure is not None:
        kind, msg = failure
        raise (ConfigError if kind == "ConfigError" else RunError)(msg)
    return result


def broadcast_world(obj: Optional[Any]) -> Optional[Any]:
    """Rank 0's small object to every process of the job (all ranks, not only DP: a TP
    peer must stop too). In memory only; nothing read from disk goes through pickle."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
