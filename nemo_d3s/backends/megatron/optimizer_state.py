"""Optimizer state of the Megatron backend's checkpoints: Adam's step count, and the
distributed optimizer's per-DP-rank ranges of ``p.view(-1)`` <-> the per-parameter tensors
the plain path writes (``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>``,
``optim.main.<name>``), so either optimizer resumes the other's checkpoint at any layout.
Saving gathers one full tensor at a time (the writer streams it to the shard file before the
next); resuming at the saved layout reads only each DP rank's range.
Uses ``DistributedOptimizer`` internals present in megatron-core 0.15.3, 0.16.1 and 0.19.2.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "MOMENTS",
    "agreed_step",
    "distributed_optimizers",
    "gathered_entries",
    "iter_gathered_states",
    "local_ranges",
    "optimizer_step",
    "scatter_states",
]

MOMENTS = ("exp_avg", "exp_avg_sq")


def distributed_optimizers(optimizer: Any) -> List[Any]:
    """The ``DistributedOptimizer`` objects behind ``optimizer`` (one, or a chain's)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _owners(optimizer: Any) -> Dict[torch.nn.Parameter, Any]:
    """model parameter -> the DistributedOptimizer holding a range of it on THIS rank."""
    out = {}
    for dopt in distributed_optimizers(optimizer):
        for p in dopt.model_param_group_index_map:
            out[p] = dopt
    return out


def optimizer_step(optimizer: Any) -> int:
    """Adam's step count on this rank (0 before the first step), per parameter (torch) or
    per param group (TE's FusedAdam)."""
    for opt in distributed_optimizers(optimizer):
        inner = getattr(opt, "optimizer", opt)  # a Megatron optimizer wraps a torch-style one
        for st in inner.state.values():
            if "step" in st:
                return int(st["step"])
        for g in inner.param_groups:
            if g.get("params") and "step" in g:
                return int(g["step"])
    return 0


def agreed_step(optimizer: Any, dp_group: Optional[dist.ProcessGroup]) -> int:
    """:func:`optimizer_step` agreed by a MAX all-reduce over ``dp_group`` (a padding-only
    rank has no state)."""
    step = optimizer_step(optimizer)
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return step
    t = torch.tensor([step], dtype=torch.int64, device=_group_device(dp_group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    return int(t.item())


def _group_device(group: dist.ProcessGroup) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


def local_ranges(optimizer: Any) -> Dict[torch.nn.Parameter, Tuple[int, int]]:
    """model parameter -> [start, end) of ``p.view(-1)`` this DP rank holds the state of."""
    out = {}
    for p, dopt in _owners(optimizer).items():
        r = dopt._get_model_param_range_map(p)["param"]
        out[p] = (int(r.start), int(r.end))
    return out


def gathered_entries(
    named_params: Iterable[Tuple[str, torch.nn.Parameter]], *, with_main: bool, step: int
) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """(key, shape, dtype) of what :func:`iter_gathered_states` yields for these parameters,
    known before any collective (a streamed file's header)."""
    if step <= 0:
        return []
    keys = (*MOMENTS, "main") if with_main else MOMENTS
    return [
        (f"optim.{k}.{name}", tuple(p.shape), torch.float32)
        for name, p in named_params
        for k in keys
    ]


@torch.no_grad()
def iter_gathered_states(
    optimizer: Any,
    named_params: Iterable[Tuple[str, torch.nn.Parameter]],
    dp_group: Optional[dist.ProcessGroup],
    *,
    with_main: bool,
    step: int,
    dst: int = 0,
) -> Iterator[Tuple[str, Optional[torch.Tensor]]]:
    """Yields ``(optim.<moment>.<name>, t)`` per parameter in :func:`gathered_entries`' order:
    ``t`` the full fp32 CPU tensor on DP rank ``dst``, None elsewhere; nothing at ``step`` 0.
    Collective over ``dp_group``: every rank iterates to the end (same params, order, ``step``);
    one SUM reduce per tensor of disjoint zero-padded ranges. Memory: one full tensor at a time."""
    if step <= 0:
        return
    owners = _owners(optimizer)
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    root = dist.get_global_rank(dp_group, dst) if dp_group is not None else 0
    is_root = dp_group is None or dist.get_rank(dp_group) == dst
    keys = (*MOMENTS, "main") if with_main else MOMENTS
    for name, p in named_params:
        dopt = owners.get(p)
        mine: Dict[str, Any] = {}
        if dopt is not None:
            r = dopt._get_model_param_range_map(p)["param"]
            states = dopt._get_main_param_and_optimizer_states(p)
            mine = {k: (r, states["param" if k == "main" else k]) for k in keys}
        for k in keys:
            full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if k in mine:
                r, t = mine[k]
                full[r.start : r.end] = t.detach().reshape(-1).float()
            if dp_size > 1:
                dist.reduce(full, dst=root, group=dp_group)
            yield f"optim.{k}.{name}", full.view(p.shape).cpu() if is_root else None


@torch.no_grad()
def scatter_states(
    optimizer: Any,
    named_params: Iterable[Tuple[str, torch.nn.Parameter]],
    ranged: Dict[str, Dict[str, torch.Tensor]],
    step: int,
) -> None:
    """Set this rank's main weights and (``step`` > 0) moments and step count from
    ``ranged[name]`` (this rank's range of each; "main" defaults to the parameter, so call it
    after loading the model). No collective. Main weights are always set, else the next
    step copies the built weights back over the loaded ones."""
    owners = _owners(optimizer)
    plan = []  # read everything (main weights from the parameters too) before the dummy step
    for name, p in named_params:
        dopt = owners.get(p)
        if dopt is None:
            continue
        r = dopt._get_model_param_range_map(p)["param"]
        src = ranged.get(name, {})
        main = src.get("main")
        if main is None:
            main = p.detach().reshape(-1)[r.start : r.end].clone()
        plan.append(
            (name, p, dopt, {"param": main, **({k: src[k] for k in MOMENTS} if step > 0 else {})})
        )
    if step > 0:
        for dopt in distributed_optimizers(optimizer):
            if not dopt.optimizer.state:
                dopt._init_optimizer_states_with_dummy_values()
    for name, p, dopt, values in plan:
        current = dopt._get_main_param_and_optimizer_states(p)
        if step > 0 and "step" in current:
            values["step"] = torch.tensor(float(step))
        missing = set(current) - set(values)
        if missing:
            raise RuntimeError(
                f"{name}: the optimizer keeps {sorted(missing)} that the checkpoint does "
                "not restore"
            )
        dopt._set_main_param_and_optimizer_states(
            p,
            {
                k: values[k].to(current[k].device, current[k].dtype).view_as(current[k])
                for k in current
            },
        )
    if step > 0:
        for dopt in distributed_optimizers(optimizer):
            for g in dopt.optimizer.param_groups:
                if "step" in g:  # Transformer Engine's FusedAdam counts per group
                    g["step"] = step
