"""How long a collective waits for a stopped peer: one setting for every process group.

``trainer.dist_timeout_minutes`` is the one timeout of a run. torch gives a group it
creates without a ``timeout`` the backend's default (30 minutes for gloo, 10 for NCCL:
torch 2.13 ``distributed/distributed_c10d.py:836-849`` ``_get_default_timeout``), whatever
the world's timeout is; Megatron creates its groups with ``distributed_timeout_minutes``
(default 30) and a few gloo groups with none (megatron-core 0.16.1
``parallel_state.py:1278-1280``, the expert data-parallel gloo group). So every group the
run creates is built with the configured timeout, and :func:`apply_timeout` sets it on
any group created without one.

Reading a group's timeout (torch 2.13, ``_C/_distributed_c10d.pyi``): a ``ProcessGroup``
holds one backend per device type (``ProcessGroup._get_backend(device)``, line 642), whose
``options._timeout`` is the timeout its collectives wait (``Backend.Options._timeout``,
lines 316-323; ``distributed_c10d.py:2168-2174`` hands the gloo backend the group's
``timeout``, ``:2198`` the NCCL options). Setting it: ``distributed_c10d._set_pg_timeout``
(``distributed_c10d.py:1616-1661``; megatron-core's ``update_pg_timeout`` calls the same).
"""

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
    """{device type: timeout} of each backend ``group`` holds (gloo: "cpu", NCCL: "cuda")."""
    out = {}
    for device in group._device_types:
        backend = group._get_backend(torch.device(device.type))
        out[device.type] = backend.options._timeout
    return out


def groups_of_this_process() -> List[dist.ProcessGroup]:
    """Every process group this process is a member of (the world included), in creation
    order: torch's registry of groups (``distributed_c10d._world.pg_map``, line 703)."""
    return list(dist.distributed_c10d._world.pg_map)


def apply_timeout(timeout: Optional[datetime.timedelta]) -> int:
    """Give every group of this process whose backends wait another time ``timeout``; returns
    how many were changed. No collective (each rank sets its own backends); None: nothing."""
    if timeout is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    changed = 0
    for g in groups_of_this_process():
        if any(t != timeout for t in group_timeout(g).values()):
            dist.distributed_c10d._set_pg_timeout(timeout, g)
            changed += 1
    return changed
