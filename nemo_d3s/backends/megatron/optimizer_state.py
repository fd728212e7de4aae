"""The optimizer state of the Megatron backend's checkpoints: Adam's step count (either
optimizer), and the distributed optimizer's state <-> the backend's sharded checkpoint
tensors (:func:`iter_gathered_states`, :func:`scatter_states`).

Megatron's ``DistributedOptimizer`` keeps, per model parameter ``p`` (this rank's TP/PP
shard), only a contiguous range of ``p.view(-1)`` on each DP rank: the fp32 main weights
and Adam's ``exp_avg`` / ``exp_avg_sq`` of that range (``_get_model_param_range_map(p)
["param"]``). The backend's checkpoint stores per-parameter tensors of the local TP/PP
shard (the same keys the plain-AdamW path writes: ``optim.exp_avg.<name>``,
``optim.exp_avg_sq.<name>``, plus ``optim.main.<name>`` when the model's dtype is not
fp32), so a checkpoint written with either optimizer resumes with either, at any layout.

:func:`iter_gathered_states` assembles the full tensors on one DP rank, one at a time (every
DP rank contributes its range, zeros elsewhere, summed with one ``reduce`` per tensor over
the DP group; the ranges of the DP ranks are disjoint and cover ``p``, so the sum is exact).
:func:`scatter_states` copies each rank's range back out of full tensors that every DP
rank read from the checkpoint (no collective).

Memory: one full fp32 copy of the tensor being gathered on top of the optimizer's own
state; the checkpoint writer streams each into its shard file before the next is gathered
(``checkpoint.save_policy``), so no rank holds the stage's gathered state in host memory.

Uses megatron-core's ``DistributedOptimizer`` internals (``model_param_group_index_map``,
``_get_model_param_range_map``, ``_get_main_param_and_optimizer_states``,
``_init_optimizer_states_with_dummy_values``; present in 0.15.3, 0.16.1 and 0.19.2, the
versions nemo_d3s/versions.py allows); the tests pin their meaning by a save / resume round
trip at DP2 against a run that never stopped.
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
    """Adam's step count on this rank (0 before the first step), for the plain AdamW or
    Megatron's optimizer: torch's Adam keeps it per parameter, Transformer Engine's FusedAdam
    (Megatron's choice on GPU) per param group."""
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
    """:func:`optimizer_step`, the same on every DP rank (a rank whose buffer range holds only
    padding has no state to read it from). One all-reduce (MAX) over ``dp_group``."""
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
    """model parameter -> [start, end) of ``p.view(-1)`` whose main weights and moments THIS
    DP rank holds (parameters it holds nothing of are absent)."""
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
    """Collective over ``dp_group``, one tensor at a time: every DP rank iterates it to the
    end with the same parameters in the same order and the same ``step`` (e.g.
    :func:`agreed_step`). Yields ``(optim.exp_avg.<name>, t)``, ``(optim.exp_avg_sq.<name>,
    t)`` (and ``optim.main.<name>`` with ``with_main``) per parameter, in
    :func:`gathered_entries`' order: ``t`` the fp32 CPU tensor of ``p``'s shape on the DP rank
    ``dst``, None on the others; nothing when ``step`` is 0 (no moments exist yet).

    Collectives: ``len(params) x (2 or 3)`` reduces of ``p.numel()`` fp32 elements over DP.
    Memory: one full fp32 tensor at a time (the caller writes it before asking for the next)."""
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
    """Set this rank's main weights and (``step`` > 0) Adam moments and step count.
    ``ranged[name]`` holds, for each parameter this rank has a range of (:func:`local_ranges`),
    that range of the flattened ``"exp_avg"`` / ``"exp_avg_sq"`` and optionally ``"main"``
    (fp32 main weights; default: the parameter's own values, so call this AFTER the model
    parameters hold the checkpoint's). No collective.

    The main weights are always set: a bf16 model's fp32 copies would otherwise keep the
    weights the model was built with, and the next step would copy them back over the
    loaded ones. Before the first step the inner optimizer has no state to copy into: it is
    created by Megatron's dummy-value step first, which moves the main weights (weight
    decay); they are overwritten right after."""
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
