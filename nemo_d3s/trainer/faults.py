"""Faults a run reports to its user, and named fault-injection points for the tests.

:class:`~nemo_d3s.errors.RunError` (the run's files or surroundings) prints one ``error:`` line
and exits 2. Fault injection: :func:`~nemo_d3s.fault_points.fault_point`, re-exported here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Tuple, Union

from nemo_d3s.errors import ConfigError, RunError  # RunError re-exported: its home before errors.py
from nemo_d3s.fault_points import fault_point  # re-exported: the trainer's points use it

__all__ = ["RunError", "fault_point", "agree_on_main", "agreed_refit", "first_line"]

log = logging.getLogger("nemo_d3s.trainer")


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (torch's are often pages long)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def agreed_refit(
    sync: Callable[[], None], agree: Callable[[bool], Tuple[bool, Union[int, bool]]]
) -> bool:
    """``sync()`` (a refit), then ``agree(failed here)`` -> (a stop signal pending on some
    rank, on how many ranks the refit failed: a count, or a bool where the agreement counts
    nothing), collective over the ranks that refit together.
    A failure without a stop raises on every rank (this rank's own exception where it failed,
    the count elsewhere); a failure a stop explains (an RPC into an engine going down with the
    job) is logged. Returns whether a stop is pending: the caller checkpoints the update
    either way."""
    failure = None
    try:
        sync()
    except Exception as e:  # raised below unless a stop signal explains it
        failure = e
    stopping, failed = agree(failure is not None)
    if failed and not stopping:
        if failure is not None:
            raise failure
        where = "another rank" if isinstance(failed, bool) else f"{failed} rank(s)"
        raise RuntimeError(f"the refit failed on {where} (its log says why)")
    if failure is not None:
        log.warning("the refit stopped with the job (%s)", first_line(failure))
    return stopping


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
