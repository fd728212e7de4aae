"""Data-parallel bookkeeping for the trainer: process-group set-up and small reductions.

The loop runs unchanged with one process (``world_size == 1``: every reduction is the
identity) or under ``torchrun`` (``WORLD_SIZE > 1``: one gloo group on CPU, NCCL on GPU).
Only small tensors (counters, per-sample rewards) travel through these helpers; gradient
reduction belongs to the backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = ["DPInfo", "init_distributed", "shard_range"]


@dataclass
class DPInfo:
    """This process's place in the data-parallel group. ``group`` is None for one process."""

    rank: int = 0  # rank within the data-parallel group (shards the prompts)
    world_size: int = 1  # data-parallel size
    group: Any = None
    owns_process_group: bool = False
    global_rank: int = 0  # rank in the world: only global rank 0 writes files

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0

    def with_group(self, group: Any) -> "DPInfo":
        """The same process seen through another data-parallel group (e.g. Megatron's,
        whose DP group excludes the tensor/pipeline-parallel peers)."""
        if group is None or not dist.is_initialized():
            return self
        return DPInfo(dist.get_rank(group), dist.get_world_size(group), group, self.owns_process_group,
                      dist.get_rank())

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def sum(self, values: Dict[str, float]) -> Dict[str, float]:
        """Sum a dict of scalars over ranks (one float64 all-reduce). Every rank must pass
        the same keys: the values are packed in sorted-key order."""
        if not self.distributed or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    def max(self, value: float) -> float:
        if not self.distributed:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """[n] on every rank (same n) -> [world_size * n] in rank order."""
        if not self.distributed:
            return x
        parts: List[torch.Tensor] = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

    def barrier(self) -> None:
        """All processes of the job (not only the DP group): file-system hand-overs."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def shutdown(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: str = "cpu") -> DPInfo:
    """Join the default process group when launched by torchrun (``WORLD_SIZE > 1``).

    gloo on CPU, NCCL when the model lives on CUDA. The whole world is the data-parallel
    group here; a Megatron backend would take its DP group from ``parallel_state`` instead.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DPInfo()
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        owns = True
    return DPInfo(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, owns, dist.get_rank())


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous slice [lo, hi) of ``n`` items for ``rank``; requires n % world_size == 0
    so that every rank holds the same number of prompt groups."""
    if n % world_size:
        raise ValueError(f"cannot shard {n} prompts evenly over {world_size} ranks")
    per = n // world_size
    return rank * per, (rank + 1) * per


def optional_group(info: Optional[DPInfo]) -> Any:
    return None if info is None else info.group
