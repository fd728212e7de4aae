"""Small collective helpers shared by the distributed modules.

Every helper takes the process group explicitly. ``group=None`` means "no group": one
process, every collective is the identity (it does NOT mean torch's default world group;
callers that want the world pass ``torch.distributed.group.WORLD``). Tensors travel on the
device of their inputs, so the same code runs on gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "group_rank",
    "group_size",
    "is_single",
    "global_rank_of",
    "collective_device",
    "device_for_backend",
    "all_gather_counts",
    "all_gather_varlen",
    "exclusive_prefix",
]


def is_single(group: Optional[dist.ProcessGroup]) -> bool:
    """True when ``group`` is None, torch.distributed is not initialised, or the group has
    one member: the caller should use the single-process (core) function."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_world_size(group) == 1


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``group`` (0 for no group or one rank)."""
    return 0 if is_single(group) else dist.get_rank(group)


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """The size of ``group`` (1 for no group)."""
    return 1 if is_single(group) else dist.get_world_size(group)


def device_for_backend(backend: str) -> torch.device:
    """Where a small collective tensor must live for a group of backend ``backend``.

    ``"gloo"`` -> CPU; ``"nccl"`` -> the current CUDA device; a device-mapped backend such as
    ``"cpu:gloo,cuda:nccl"`` -> CPU, because it carries CPU tensors itself and counters need
    no host-device copy. Anything else (mpi, ucc) -> CPU.
    """
    name = str(backend).lower()
    if ":" in name:
        mapped = dict(part.split(":", 1) for part in name.split(","))
        if "cpu" in mapped:
            return torch.device("cpu")
        name = mapped.get("cuda", name)
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a buffer for ``group``'s collectives must live when no input tensor says so
    (see :func:`device_for_backend`); CPU for no group."""
    if is_single(group):
        return torch.device("cpu")
    return device_for_backend(dist.get_backend(group))


def global_rank_of(group: dist.ProcessGroup, rank_in_group: int) -> int:
    """Global rank of member ``rank_in_group`` of ``group`` (torch's ``src`` arguments are
    global ranks)."""
    return dist.get_global_rank(group, rank_in_group)


def all_gather_counts(
    n: int, group: Optional[dist.ProcessGroup], device: torch.device
) -> torch.Tensor:
    """Every member's integer ``n``: -> LongTensor [world] in group-rank order.
    One all-gather of one int64 per rank."""
    mine = torch.tensor([int(n)], dtype=torch.long, device=device)
    if is_single(group):
        return mine
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts)


def all_gather_varlen(
    x: torch.Tensor, group: Optional[dist.ProcessGroup], counts: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenate every member's ``x`` [n_r, *rest] in group-rank order.

    Ranks may hold different n_r (zero included); ``rest`` and dtype must agree. Returns
    (gathered [sum_r n_r, *rest], counts [world] long). Collectives: one all-gather of the
    counts (skipped when ``counts`` is passed) and one all-gather of ``x`` padded to
    ``max_r n_r`` rows. Memory: world x max_r n_r x rest.
    """
    if is_single(group):
        return x, torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    if counts is None:
        counts = all_gather_counts(x.shape[0], group, x.device)
    n_max = int(counts.max())
    padded = x.new_zeros((n_max,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts: List[torch.Tensor] = [
        torch.empty_like(padded) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(parts, padded, group=group)
    pieces = [p[: int(c)] for p, c in zip(parts, counts.tolist())]
    return torch.cat(pieces), counts


def exclusive_prefix(counts: torch.Tensor) -> torch.Tensor:
    """counts [world] -> [world] with ``out[r] = sum_{r' < r} counts[r']``."""
    return torch.cumsum(counts, 0) - counts
