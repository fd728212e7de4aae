"""How long a collective waits for a stopped peer: ``trainer.dist_timeout_minutes`` for every
process group of the run. torch gives a group created without a ``timeout`` the backend's default
(gloo 30, NCCL 10 minutes: torch 2.13 ``distributed_c10d.py:836-849``), and megatron-core creates
some gloo groups without one (0.16.1 ``parallel_state.py:1278-1280``), so :func:`apply_timeout` sets
it on every group afterwards."""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = ["as_timedelta", "group_timeout", "groups_of_this_process", "apply_timeout"]


def as_timedelta(minutes: Optional[float]) -> Optional[datetime.timedelta]:
    """``trainer.dist_timeout_minutes`` as a timedelta (None: not configured)."""
    return None if not minutes else datetime.timedelta(minutes=float(minutes))


def group_timeout(group: dist.ProcessGroup) -> Dict[str, datetime.timedelta]:
    """{device type: timeout} of each backend ``group`` holds (gloo: "cpu", NCCL: "cuda"): the
    backend's ``options._timeout``, what its collectives wait (torch 2.13
    ``_C/_distributed_c10d.pyi`` lines 316-323, 642; ``distributed_c10d.py:2168-2174``,
    ``:2198``)."""
    out = {}
    for device in group._device_types:
        backend = group._get_backend(torch.device(device.type))
        out[device.type] = backend.options._timeout
    return out


def groups_of_this_process() -> List[dist.ProcessGroup]:
    """Every process group this process is a member of, world included, in creation order
    (``distributed_c10d._world.pg_map``, torch 2.13 line 703)."""
    return list(dist.distributed_c10d._world.pg_map)


def apply_timeout(timeout: Optional[datetime.timedelta]) -> int:
    """Give every group of this process ``timeout``; returns how many changed. No collective; None:
    nothing."""
    if timeout is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    changed = 0
    for g in groups_of_this_process():
        if any(t != timeout for t in group_timeout(g).values()):
            # torch 2.13 distributed_c10d.py:1616-1661 (megatron-core's update_pg_timeout too)
            dist.distributed_c10d._set_pg_timeout(timeout, g)
            changed += 1
    return changed
