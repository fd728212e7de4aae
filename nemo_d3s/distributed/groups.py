"""The parallel layout a run trains in, and the small collectives the trainer needs.

:class:`ParallelGroups` is a frozen record of the dp / tp / pp / cp groups and of the device small
collective tensors live on (CPU for gloo, the current CUDA device for NCCL); the policy builds it,
the trainer only reads it. Its reductions hand back CPU values; gradient reduction belongs to the
policy. A None group has one member: a one-process run is every group None."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from nemo_d3s.distributed.comm import device_for_backend, group_rank, group_size, is_single

__all__ = ["ParallelGroups", "device_for_backend", "init_world", "shard_range"]


@dataclass(frozen=True)
class ParallelGroups:
    """This process's place in the parallel layout. dp: ranks holding different samples (TP / PP /
    CP peers hold the same ones); tp / pp / cp: None when that dimension is 1; device: where small
    collective tensors live; global_rank (only 0 writes files); owns_world: :meth:`shutdown`
    destroys the process group this record's builder initialised."""

    dp: Optional[dist.ProcessGroup] = None
    tp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    cp: Optional[dist.ProcessGroup] = None
    device: torch.device = torch.device("cpu")
    global_rank: int = 0
    owns_world: bool = False

    # ------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp)

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the process that writes files and speaks for the job."""
        return self.global_rank == 0

    @property
    def data_parallel(self) -> bool:
        return self.dp_size > 1

    # ------------------------------------------------------------------ small collectives
    def sum(self, values: Dict[str, float], *, keys_may_differ: bool = False) -> Dict[str, float]:
        """Sum a dict of scalars over ``dp``: one float64 all-reduce of [len(values)]. Every rank
        passes the same keys unless ``keys_may_differ``: then the key union is gathered first (one
        small object all-gather) and a missing key counts as 0."""
        if not self.data_parallel:
            return {k: float(v) for k, v in values.items()}
        if keys_may_differ:
            everyone: List[Any] = [None] * self.dp_size
            dist.all_gather_object(everyone, sorted(values), group=self.dp)
            values = {k: values.get(k, 0.0) for k in sorted(set().union(*everyone))}
        if not values:
            return {}
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp)
        return dict(zip(keys, t.cpu().tolist()))

    def max(self, value: float) -> float:
        """Max of one float over every group of the layout (dp, tp, pp, cp): a stop signal must
        reach a rank's model-parallel peers too, or they wait for it in their next collective."""
        groups = [g for g in (self.dp, self.tp, self.pp, self.cp) if g is not None]
        if not groups:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        for g in groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return float(t.item())

    def barrier(self) -> None:
        """All processes of the job (not only ``dp``): file-system hand-overs."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def shutdown(self) -> None:
        if self.owns_world and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def init_world(device: str = "cpu", timeout_minutes: Optional[float] = None) -> ParallelGroups:
    """Join the default process group under torchrun (``WORLD_SIZE > 1``) -> the record of a pure
    data-parallel layout: gloo on CPU, NCCL on CUDA (device from ``LOCAL_RANK``), collectives
    waiting ``timeout_minutes`` for a stopped peer. An existing process group is reused, not owned;
    one process: every group None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = str(device).startswith("cuda")
    if world <= 1 and not (dist.is_available() and dist.is_initialized()):
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return ParallelGroups(device=dev)
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs = {}
        if timeout_minutes:
            kwargs["timeout"] = datetime.timedelta(minutes=float(timeout_minutes))
        dist.init_process_group(backend=backend, **kwargs)
        owns = True
    world_group = dist.group.WORLD
    dp = None if is_single(world_group) else world_group
    dev = device_for_backend(dist.get_backend(world_group))
    return ParallelGroups(dp=dp, device=dev, global_rank=dist.get_rank(), owns_world=owns)


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous slice [lo, hi) of ``n`` items for ``rank``; n % world_size must be 0 (every rank
    holds as many prompt groups)."""
    if n % world_size:
        raise ValueError(f"cannot shard {n} prompts evenly over {world_size} ranks")
    per = n // world_size
    return rank * per, (rank + 1) * per
