"""Megatron's distributed optimizer <-> the backend's sharded checkpoint tensors.

Megatron's ``DistributedOptimizer`` keeps, per model parameter ``p`` (this rank's TP/PP
shard), only a contiguous range of ``p.view(-1)`` on each DP rank: the fp32 main weights
and Adam's ``exp_avg`` / ``exp_avg_sq`` of that range (``_get_model_param_range_map(p)
["param"]``). The backend's checkpoint stores per-parameter tensors of the local TP/PP
shard (the same keys the plain-AdamW path writes: ``optim.exp_avg.<name>``,
``optim.exp_avg_sq.<name>``, plus ``optim.main.<name>`` when the model's dtype is not
fp32), so a checkpoint written with either optimizer resumes with either, at any layout.

:func:`gather_states` assembles the full tensors on DP rank 0 (every DP rank contributes
its range, zeros elsewhere, summed with one ``reduce`` per tensor over the DP group; the
ranges of the DP ranks are disjoint and cover ``p``, so the sum is exact).
:func:`scatter_states` copies each rank's range back out of full tensors that every DP
rank read from the checkpoint (no collective).

Memory: one full fp32 copy of the parameter being gathered (x3 for its main weights and
two moments) on top of the optimizer's own state; on DP rank 0 the gathered tensors of
the whole stage, moved to the CPU as they complete (the checkpoint writer holds the
stage's tensors anyway).

Uses megatron-core 0.16's ``DistributedOptimizer`` internals (``model_param_group_index_map``,
``_get_model_param_range_map``, ``_get_main_param_and_optimizer_states``,
``_init_optimizer_states_with_dummy_values``); the tests pin their meaning by a
save / resume round trip at DP2 against a run that never stopped.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["MOMENTS", "distributed_optimizers", "gather_states", "optimizer_step", "scatter_states"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def distributed_optimizers(optimizer: Any) -> List[Any]:
    """The ``DistributedOptimizer`` objects behind ``optimizer`` (a ChainedOptimizer holds
    one per (dtype, ...) group)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _owners(optimizer: Any) -> Dict[torch.nn.Parameter, Any]:
    """model parameter -> the DistributedOptimizer that holds a range of it on THIS rank
    (a parameter outside this rank's buffer range is absent)."""
    out = {}
    for dopt in distributed_optimizers(optimizer):
        for p in dopt.model_param_group_index_map:
            out[p] = dopt
    return out


def optimizer_step(optimizer: Any) -> int:
    """Adam's step count (the same on every rank and parameter; 0 before the first step)."""
    for dopt in distributed_optimizers(optimizer):
        for st in dopt.optimizer.state.values():
            if "step" in st:
                return int(st["step"])
    return 0


@torch.no_grad()
def gather_states(optimizer: Any, named_params: Iterable[Tuple[str, torch.nn.Parameter]],
                  dp_group: Optional[dist.ProcessGroup], *, with_main: bool) -> Dict[str, torch.Tensor]:
    """Collective over ``dp_group`` (every DP rank calls it with the same parameters in the
    same order). Returns, on DP rank 0, ``optim.exp_avg.<name>`` / ``optim.exp_avg_sq.<name>``
    (and ``optim.main.<name>`` with ``with_main``) as fp32 CPU tensors of ``p``'s shape; {}
    on the other DP ranks and before the first step (no moments exist yet).

    Collectives: ``len(params) x (2 or 3)`` reduces of ``p.numel()`` fp32 elements over DP."""
    if optimizer_step(optimizer) == 0:
        return {}
    owners = _owners(optimizer)
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    root = dist.get_global_rank(dp_group, 0) if dp_group is not None else 0
    is_root = dp_group is None or dist.get_rank(dp_group) == 0
    keys = (*MOMENTS, "main") if with_main else MOMENTS
    out: Dict[str, torch.Tensor] = {}
    for name, p in named_params:
        dopt = owners.get(p)
        mine: Dict[str, torch.Tensor] = {}
        if dopt is not None:
            r = dopt._get_model_param_range_map(p)["param"]
            states = dopt._get_main_param_and_optimizer_states(p)
            mine = {k: (r, states["param" if k == "main" else k]) for k in keys}
        for k in keys:
            full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if k in mine:
                r, t = mine[k]
                full[r.start:r.end] = t.detach().reshape(-1).float()
            if dp_size > 1:
                dist.reduce(full, dst=root, group=dp_group)
            if is_root:
                out[f"optim.{k}.{name}"] = full.view(p.shape).cpu()
    return out


@torch.no_grad()
def scatter_states(optimizer: Any, named_params: Iterable[Tuple[str, torch.nn.Parameter]],
                   full: Dict[str, Dict[str, torch.Tensor]], step: int) -> None:
    """Set this rank's ranges of the main weights and Adam moments from full local tensors
    (``full[name] = {"main": ..., "exp_avg": ..., "exp_avg_sq": ...}``, each ``p``'s shape;
    ``main`` defaults to the parameter's current value) and Adam's step to ``step``. Call it
    AFTER the model parameters hold the checkpoint's values. No collective.

    Before the first step the inner optimizer has no state to copy into: it is created
    first (Megatron's dummy-value step), which also touches the main weights; they are
    overwritten right after."""
    if step <= 0:
        return
    dopts = distributed_optimizers(optimizer)
    for dopt in dopts:
        if not dopt.optimizer.state:
            saved = {p: p.detach().clone() for p in dopt.model_param_group_index_map}
            dopt._init_optimizer_states_with_dummy_values()
            for p, value in saved.items():  # the dummy step's weight decay moved them
                p.copy_(value)
    owners = _owners(optimizer)
    for name, p in named_params:
        dopt = owners.get(p)
        if dopt is None:
            continue
        r = dopt._get_model_param_range_map(p)["param"]
        states = dopt._get_main_param_and_optimizer_states(p)
        src = full[name]
        main = src.get("main")
        if main is None:
            main = p.detach()
        for key, value in (("param", main), *((k, src[k]) for k in MOMENTS)):
            dst = states[key]
            dst.copy_(value.reshape(-1)[r.start:r.end].to(dst.dtype).view_as(dst))
        if "step" in states:
            states["step"].fill_(float(step))
