"""The Megatron backend's optimizers and the gradient handling of the plain one.

- :func:`build_optimizer`: plain ``torch.optim.AdamW`` over this rank's shards (the CPU
  default), or Megatron's ``DistributedDataParallel`` + distributed optimizer (the CUDA
  default; the tests run it on gloo through ``cpu_compat``).
- The plain path's gradient steps, called by ``schedule.train_step``: :func:`finalize_grads`
  (DP average, tied-embedding sum), :func:`global_grad_norm`, :func:`clip_grads_`.
- The distributed optimizer's state <-> the backend's sharded checkpoint tensors:
  ``optimizer_state.py``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from nemo_d3s.backends.megatron.main_weights import MainWeightsAdamW, grad_of, needs_main_weights
from nemo_d3s.backends.megatron.moe import ExpertGroups
from nemo_d3s.distributed.comm import group_rank, is_single
from nemo_d3s.formats.moe import is_expert_param
from nemo_d3s.distributed.groups import ParallelGroups

__all__ = [
    "Model",
    "build_optimizer",
    "clip_grads_",
    "device_of",
    "expert_param_ids",
    "finalize_grads",
    "global_grad_norm",
    "is_megatron_optimizer",
    "local_params",
    "model_chunks",
    "unwrap_model",
    "uses_distributed_optimizer",
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
    """The device of ``module``'s first parameter (CPU for none)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------- gradients
def local_params(chunks: List[torch.nn.Module]) -> List[torch.nn.Parameter]:
    """This rank's trainable parameters over its model chunks, in chunk order."""
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
    experts = expert_param_ids(chunks)
    grads = [grad_of(p, zeros=True) for p in params]
    dense = [g for p, g in zip(params, grads) if id(p) not in experts]
    _average(dense, groups.dp, groups.dp_size)
    if experts:
        # An expert's gradient holds every DP rank's tokens routed to it: summed over the
        # ranks holding the same expert shard, divided by DP as the dense ones (megatron-core
        # 0.16.1 distributed/distributed_data_parallel.py:285-288).
        expert_grads = [g for p, g in zip(params, grads) if id(p) in experts]
        _average(expert_grads, ExpertGroups.current().edp, groups.dp_size)
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


def _average(grads: List[torch.Tensor], group, divisor: int) -> None:
    """Sum ``grads`` over ``group`` (one flat all-reduce per dtype) and divide by ``divisor``."""
    if divisor == 1 and is_single(group):
        return
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        if not is_single(group):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= divisor
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def expert_param_ids(chunks: List[torch.nn.Module]) -> set:
    """``id()`` of every expert parameter of ``chunks`` (``formats.moe.is_expert_param``)."""
    return {id(p) for c in chunks for n, p in c.named_parameters() if is_expert_param(n)}


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
    ``groups.pp`` (= the TP x PP grid); the experts' over their ETP x EP x PP grid, added
    (megatron-core clips dense and expert parameters on one norm the same way). No host
    sync."""
    chunks = model_chunks(chunks)
    experts = expert_param_ids(chunks)
    params = [p for p in local_params(chunks) if grad_of(p) is not None]
    dense = [grad_of(p) for p in params if id(p) not in experts and _counts_for_norm(p, groups)]
    sq = _square_sum(dense, groups.device)
    for g in (groups.tp, groups.pp):
        if not is_single(g):
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=g)
    if experts:
        emp = ExpertGroups.current().emp
        # every expert shard is marked tensor-parallel (model._mark_tensor_parallel), so
        # each counts once over the ETP x EP x PP grid
        esq = _square_sum([grad_of(p) for p in params if id(p) in experts], groups.device)
        if not is_single(emp):
            dist.all_reduce(esq, op=dist.ReduceOp.SUM, group=emp)
        sq = sq + esq
    return sq.sqrt()[0]


def _square_sum(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[1] f64 on ``device``: the sum of the squared L2 norms of ``grads`` (fp32 each)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return norms.double().pow(2).sum().to(device).reshape(1)


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
    """Whether ``optimizer`` is megatron-core's (distributed or not), not the plain path's."""
    try:
        from megatron.core.optimizer import MegatronOptimizer
    except ImportError:  # pragma: no cover - megatron-core is a dependency of this backend
        return False
    return isinstance(optimizer, MegatronOptimizer)


def uses_distributed_optimizer(setting: Optional[bool], device: torch.device) -> bool:
    """``model.params.distributed_optimizer`` resolved: None means on CUDA only."""
    return device.type == "cuda" if setting is None else bool(setting)


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
    if not uses_distributed_optimizer(distributed_optimizer, device):
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
