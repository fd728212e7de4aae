"""Small collective helpers shared by the distributed modules. Every helper takes its group
explicitly; ``group=None`` means one process (every collective the identity), NOT torch's world
group. Tensors travel on their inputs' device, so gloo and NCCL run the same code."""

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
    """True when ``group`` is None, torch.distributed is not initialised, or the group has one
    member (use the core function)."""
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
    """Where a small collective tensor lives for ``backend``: the current CUDA device for "nccl";
    CPU for gloo, device-mapped backends ("cpu:gloo,cuda:nccl") and anything else."""
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
    """Where a buffer for ``group``'s collectives lives when no input says so; CPU for no group."""
    if is_single(group):
        return torch.device("cpu")
    return device_for_backend(dist.get_backend(group))


def global_rank_of(group: dist.ProcessGroup, rank_in_group: int) -> int:
    """Global rank of member ``rank_in_group`` (torch's ``src`` arguments are global ranks)."""
    return dist.get_global_rank(group, rank_in_group)


def all_gather_counts(
    n: int, group: Optional[dist.ProcessGroup], device: torch.device
) -> torch.Tensor:
    """Every member's int ``n`` -> LongTensor [world] in rank order; one all-gather of one int64."""
    mine = torch.tensor([int(n)], dtype=torch.long, device=device)
    if is_single(group):
        return mine
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts)


def all_gather_varlen(
    x: torch.Tensor, group: Optional[dist.ProcessGroup], counts: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every member's ``x`` [n_r, *rest] (n_r may differ, 0 included) concatenated in rank order ->
    (gathered [sum n_r, *rest], counts [world]). Collectives: an all-gather of the counts
    (unless passed) and one of ``x`` padded to max_r n_r rows."""
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
