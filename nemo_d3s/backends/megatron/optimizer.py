"""The Megatron backend's optimizers (plain AdamW over this rank's shards, or Megatron's DDP +
distributed optimizer) and the plain path's gradient steps: DP average, tied-embedding sum,
global norm over TP x PP, clipping.
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
    """This rank's model chunks: one stage, or the virtual stages of an interleaved pipeline."""
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
    """Megatron's ``finalize_model_grads`` for the plain path's grads (``grad_of``): missing
    ones become zeros, all are AVERAGED over ``groups.dp`` (x CP: Megatron's DP-CP group; one
    flat all-reduce per dtype), and tied embeddings' two copies summed over the embedding
    group (PP > 1). SP's norm all-reduce is not done here. Memory: one flat copy of one
    dtype's grads.
    """
    chunks = model_chunks(chunks)
    params = local_params(chunks)
    experts = expert_param_ids(chunks)
    grads = [grad_of(p, zeros=True) for p in params]
    group, size = groups.dp, groups.dp_size
    if groups.cp_size > 1:  # CP ranks hold other positions of the same rows: DP x CP
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group(with_context_parallel=True)
        size = dist.get_world_size(group)
    dense = [g for p, g in zip(params, grads) if id(p) not in experts]
    _average(dense, group, size)
    if experts:
        # An expert's gradient holds every DP (x CP) rank's tokens routed to it: summed over
        # the ranks holding the same expert shard, divided by DP x CP as the dense ones
        # (megatron-core 0.16.1 distributed/distributed_data_parallel.py:284-287: both scaled
        # by 1 / dp_cp_group.size()).
        expert_grads = [g for p, g in zip(params, grads) if id(p) in experts]
        _average(expert_grads, ExpertGroups.current().edp, size)
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


# The flat copy one all-reduce sums at a time: the plain path's only transient beyond its
# fp32 gradients (a copy of all of them was 4 bytes a parameter more at the reduce).
AVERAGE_BUCKET_BYTES = 256 * 2**20


def _average(
    grads: List[torch.Tensor], group, divisor: int, bucket_bytes: int = AVERAGE_BUCKET_BYTES
) -> None:
    """Sum ``grads`` over ``group`` and divide by ``divisor``: one flat all-reduce per dtype
    and bucket of at most ``bucket_bytes`` (a larger gradient is a bucket of its own)."""
    if divisor == 1 and is_single(group):
        return
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        bucket: List[torch.Tensor] = []
        size = 0
        for g in same:
            nbytes = g.numel() * g.element_size()
            if bucket and size + nbytes > bucket_bytes:
                _average_flat(bucket, group, divisor)
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            _average_flat(bucket, group, divisor)


def _average_flat(grads: List[torch.Tensor], group, divisor: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    if not is_single(group):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def expert_param_ids(chunks: List[torch.nn.Module]) -> set:
    """``id()`` of every expert parameter of ``chunks`` (``formats.moe.is_expert_param``)."""
    return {id(p) for c in chunks for n, p in c.named_parameters() if is_expert_param(n)}


def _counts_for_norm(p: torch.nn.Parameter, groups: ParallelGroups) -> bool:
    """Megatron's rule: each gradient counts once in the global norm (TP duplicates on TP
    rank 0, tied embeddings on the first stage)."""
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
    """L2 norm of the whole model's DP-reduced gradient (0-d f64 on ``groups.device``), the
    same on every rank: squared norms all-reduced over ``groups.tp`` then ``groups.pp``, the
    experts' over their ETP x EP x PP grid, added (one norm, as megatron-core clips)."""
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
    """Scale local grads by min(1, max_norm / (total_norm + 1e-6)); returns the factor."""
    if not max_norm or max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coeff = float(max_norm) / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in local_params(model_chunks(chunks)):
            if (g := grad_of(p)) is not None:
                g.mul_(coeff)
    return min(coeff, 1.0)


# ---------------------------------------------------------------------------- optimizers
def megatron_grads_finite(chunks: List[torch.nn.Module], groups: ParallelGroups) -> bool:
    """Whether every gradient in the Megatron DDP buffers is finite on every rank of the layout.
    Megatron's optimizer looks for inf / NaN only under a loss scaler, which bf16 and fp32 runs
    have none of (0.16.1 optimizer/__init__.py:427-443; optimizer.py:524-557, ``prepare_grads``
    returns False unchecked) and its clip leaves a NaN norm unclipped: a non-finite gradient
    went into Adam. One flag per parameter (one host sync), then ``groups.max`` (dp, tp, pp, cp):
    the rank whose reduced shard holds an inf tells the others."""
    flags = [
        torch.isfinite(p.main_grad).all()
        for c in chunks
        for p in c.parameters()
        if getattr(p, "main_grad", None) is not None
    ]
    bad = float(not bool(torch.stack(flags).all())) if flags else 0.0
    return groups.max(bad) == 0.0


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
    """(model chunks, optimizer) for ``schedule.train_step``; ``distributed_optimizer`` None
    picks Megatron's on CUDA, plain AdamW on CPU (Megatron's on CPU needs ``cpu_compat``).

    Plain: AdamW over this rank's params (``MainWeightsAdamW`` for bf16/fp16). Megatron's:
    every chunk in its DDP (fp32 grad buffers) with ``finalize_model_grads_func`` and
    ``no_sync_func`` set so the schedule reduces. Both decay every parameter, as the HF
    backend (megatron-core's ``wd_mult=0`` takes effect only in its own LR scheduler).
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
