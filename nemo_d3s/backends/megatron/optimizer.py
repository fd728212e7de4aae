"""The Megatron backend's optimizers, the gradient handling of the plain one, and the
distributed optimizer's checkpoint state.

- :func:`build_optimizer`: plain ``torch.optim.AdamW`` over this rank's shards (the CPU
  default), or Megatron's ``DistributedDataParallel`` + distributed optimizer (the CUDA
  default; the tests run it on gloo through ``cpu_compat``).
- The plain path's gradient steps, called by ``schedule.train_step``: :func:`finalize_grads`
  (DP average, tied-embedding sum), :func:`global_grad_norm`, :func:`clip_grads_`.
- The distributed optimizer's state <-> the backend's sharded checkpoint tensors
  (:func:`gather_states`, :func:`scatter_states`).

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

  Uses megatron-core's ``DistributedOptimizer`` internals (``model_param_group_index_map``,
  ``_get_model_param_range_map``, ``_get_main_param_and_optimizer_states``,
  ``_init_optimizer_states_with_dummy_values``; present in 0.15.3 and 0.16.1, the versions
  pyproject allows); the tests pin their meaning by a save / resume round trip at DP2
  against a run that never stopped.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from nemo_d3s.backends.megatron.main_weights import MainWeightsAdamW, grad_of, needs_main_weights
from nemo_d3s.distributed._comm import group_rank, is_single
from nemo_d3s.distributed.groups import ParallelGroups

__all__ = [
    "MOMENTS",
    "Model",
    "agreed_step",
    "build_optimizer",
    "clip_grads_",
    "device_of",
    "distributed_optimizers",
    "finalize_grads",
    "gather_states",
    "global_grad_norm",
    "is_megatron_optimizer",
    "local_params",
    "local_ranges",
    "model_chunks",
    "optimizer_step",
    "scatter_states",
    "unwrap_model",
]

Model = Union[torch.nn.Module, Sequence[torch.nn.Module]]


# ---------------------------------------------------------------------------- model chunks
def model_chunks(model: Model) -> List[torch.nn.Module]:
    """This rank's model chunks: one stage, or the virtual stages of an interleaved pipeline
    (the schedule checks their number against Megatron's virtual pipeline size)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("got no model chunks")
    return chunks


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------- gradients
def local_params(chunks: List[torch.nn.Module]) -> List[torch.nn.Parameter]:
    return [p for c in chunks for p in c.parameters() if p.requires_grad]


def finalize_grads(chunks: Model, groups: ParallelGroups) -> None:
    """What Megatron's ``finalize_model_grads`` does for its DDP, for the plain path's
    gradients (:func:`main_weights.grad_of`: the fp32 ``main_grad`` of a bf16 / fp16
    parameter under ``MainWeightsAdamW``, as Megatron's ``grad_reduce_in_fp32``; ``.grad``
    of an fp32 one): missing gradients become zeros; gradients are AVERAGED over
    ``groups.dp`` (one flat all-reduce SUM per dtype, then / dp_size, as Megatron's DDP does
    when the loss is not per-token); with PP > 1 and tied embeddings, the word-embedding
    gradient of the first stage and the output-layer gradient of the last stage (the two
    copies of one weight) are summed over Megatron's embedding group, so both copies take
    the same update. No sequence parallelism (its layer-norm all-reduce is not done here).

    Memory: one flat copy of the gradients of one dtype during the all-reduce.
    """
    chunks = model_chunks(chunks)
    params = local_params(chunks)
    grads = [grad_of(p, zeros=True) for p in params]
    if groups.data_parallel:
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.dp)
            flat /= groups.dp_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
    inner = unwrap_model(chunks[0])
    if groups.pp_size > 1 and getattr(inner, "share_embeddings_and_output_weights", False):
        from megatron.core import parallel_state as ps

        if ps.is_rank_in_embedding_group():
            # the first stage's first chunk holds the embedding, the last stage's last chunk
            # the output layer (one chunk each without a virtual pipeline)
            owner = unwrap_model(
                chunks[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else chunks[-1]
            )
            weight = owner.shared_embedding_or_output_weight()
            dist.all_reduce(grad_of(weight), op=dist.ReduceOp.SUM, group=ps.get_embedding_group())


def _counts_for_norm(p: torch.nn.Parameter, groups: ParallelGroups) -> bool:
    """Megatron's rule: a parameter's gradient counts once in the global norm. TP-duplicated
    parameters (layer norms, row-parallel biases) count on TP rank 0 only; the last stage's
    copy of tied embeddings (``shared``) does not count (the first stage's does)."""
    from megatron.core.transformer.module import param_is_not_shared

    if not param_is_not_shared(p):
        return False
    if is_single(groups.tp):
        return True
    # megatron.core.tensor_parallel.param_is_not_tensor_parallel_duplicate, stated here on
    # OUR tp group: 0.16 takes the group as an argument (layers.py:89-99 of 0.16.1), 0.15
    # reads it from parallel_state and takes none (layers.py:87-92 of 0.15.3).
    return bool(getattr(p, "tensor_model_parallel", False)) or group_rank(groups.tp) == 0


def global_grad_norm(chunks: Model, groups: ParallelGroups) -> torch.Tensor:
    """L2 norm of the whole model's gradient (0-d f64 tensor on ``groups.device``), identical
    on every rank. Expects gradients already reduced over DP (:func:`finalize_grads`), so DP
    replicas hold the same values and only the model-parallel shards are summed: squared
    norms (fp32 per tensor, summed in fp64) are all-reduced over ``groups.tp`` then
    ``groups.pp`` (= the TP x PP grid). No host sync."""
    chunks = model_chunks(chunks)
    grads = [
        g
        for p in local_params(chunks)
        if (g := grad_of(p)) is not None and _counts_for_norm(p, groups)
    ]
    if grads:
        sq = (
            torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            .double()
            .pow(2)
            .sum()
        )
    else:
        sq = torch.zeros((), dtype=torch.float64)
    sq = sq.to(groups.device).reshape(1)
    for g in (groups.tp, groups.pp):
        if not is_single(g):
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=g)
    return sq.sqrt()[0]


def clip_grads_(chunks: Model, max_norm: float, total_norm: float) -> float:
    """Scale every local gradient by min(1, max_norm / (total_norm + 1e-6)) (torch's and
    Megatron's formula); returns the factor. ``max_norm`` <= 0 or None: no clipping."""
    if not max_norm or max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coeff = float(max_norm) / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in local_params(model_chunks(chunks)):
            if (g := grad_of(p)) is not None:
                g.mul_(coeff)
    return min(coeff, 1.0)


# ---------------------------------------------------------------------------- optimizers
def is_megatron_optimizer(optimizer) -> bool:
    try:
        from megatron.core.optimizer import MegatronOptimizer
    except ImportError:  # pragma: no cover - megatron-core is a dependency of this backend
        return False
    return isinstance(optimizer, MegatronOptimizer)


def build_optimizer(
    model: Model,
    *,
    lr: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    grad_clip: float = 0.0,
    distributed_optimizer: Optional[bool] = None,
) -> Tuple[List[torch.nn.Module], Any]:
    """(model chunks, optimizer) for :func:`train_step`. ``distributed_optimizer``: None
    picks by the device the model lives on (CUDA: Megatron's; CPU: plain AdamW); False
    takes the plain path on CUDA too; True takes Megatron's on CPU too (gloo, with
    ``cpu_compat`` applied: how the tests run the GPU path's logic).

    Plain: the chunks unchanged and ``torch.optim.AdamW`` over this rank's parameters
    (``main_weights.MainWeightsAdamW``, AdamW on fp32 main copies, when they are bf16/fp16)
    (the
    same elementwise update as AdamW on the whole model: TP-duplicated parameters and the
    two copies of tied embeddings get identical gradients, so they stay identical);
    :func:`train_step` all-reduces the gradients over DP. Weight decay applies to every
    parameter, as in the HF backend.

    Megatron's (run on gloo/CPU by the tests; not yet on a GPU): every chunk wrapped in
    Megatron's ``DistributedDataParallel`` (fp32 gradient buffers, distributed optimizer)
    and ``get_megatron_optimizer`` (Adam with decoupled weight decay, ``clip_grad`` =
    ``grad_clip``, bf16/fp16 from the model config, fp32 main params and state); the model
    config gets ``finalize_model_grads_func`` (DP reduce-scatter, tied-embedding all-reduce)
    and ``no_sync_func`` so the schedule drives the gradient reduction. Weight decay applies
    to every parameter here too: megatron-core 0.16 marks biases and norms ``wd_mult=0``, but
    only its ``OptimizerParamScheduler`` applies that, and the backend's LR schedule sets the
    learning rate only (the HF backend's update math). For bf16/fp16 the
    chunks must already be in their training dtype (``Float16Module``-wrapped, as Megatron's
    ``get_model`` does); that is the model builder's job.
    """
    chunks = list(model_chunks(model))
    device = device_of(chunks[0])
    if distributed_optimizer is None:
        distributed_optimizer = device.type == "cuda"
    if not distributed_optimizer:
        params = local_params(chunks)
        adamw = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        if needs_main_weights(
            params
        ):  # bf16 / fp16: AdamW on fp32 main weights, or small updates round away
            return chunks, MainWeightsAdamW(params, **adamw)
        return chunks, torch.optim.AdamW(params, **adamw)
    if device.type != "cuda":
        from nemo_d3s.backends.megatron.cpu_compat import is_applied

        if not is_applied():
            raise RuntimeError(
                "Megatron's distributed optimizer on CPU needs cpu_compat.apply_cpu_compat() first"
            )
    # ---- Megatron DDP + distributed optimizer ----
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = unwrap_model(chunks[0]).config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0
        )
        for i, c in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = wrapped[0].no_sync
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_eps=eps,
        bf16=bool(getattr(config, "bf16", False)),
        fp16=bool(getattr(config, "fp16", False)),
        params_dtype=getattr(config, "params_dtype", torch.float32),
        clip_grad=float(grad_clip or 0.0),
        use_distributed_optimizer=True,
    )
    return wrapped, get_megatron_optimizer(opt_config, wrapped)


# ---------------------------------------------------------------------------- distributed optimizer state
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


@torch.no_grad()
def gather_states(
    optimizer: Any,
    named_params: Iterable[Tuple[str, torch.nn.Parameter]],
    dp_group: Optional[dist.ProcessGroup],
    *,
    with_main: bool,
    step: int,
    dst: int = 0,
) -> Dict[str, torch.Tensor]:
    """Collective over ``dp_group`` (every DP rank calls it with the same parameters in the
    same order and the same ``step``, e.g. :func:`agreed_step`). Returns, on the DP rank
    ``dst`` (a rank of ``dp_group``), ``optim.exp_avg.<name>`` / ``optim.exp_avg_sq.<name>``
    (and ``optim.main.<name>`` with ``with_main``) as fp32 CPU tensors of ``p``'s shape; {}
    on the other DP ranks and when ``step`` is 0 (no moments exist yet).

    Collectives: ``len(params) x (2 or 3)`` reduces of ``p.numel()`` fp32 elements over DP.
    Memory on ``dst``: the stage's gathered tensors (the checkpoint writer needs them all)."""
    if step <= 0:
        return {}
    owners = _owners(optimizer)
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    root = dist.get_global_rank(dp_group, dst) if dp_group is not None else 0
    is_root = dp_group is None or dist.get_rank(dp_group) == dst
    keys = (*MOMENTS, "main") if with_main else MOMENTS
    out: Dict[str, torch.Tensor] = {}
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
            if is_root:
                out[f"optim.{k}.{name}"] = full.view(p.shape).cpu()
    return out


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
                f"{name}: the optimizer keeps {sorted(missing)} that the checkpoint does not restore"
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
