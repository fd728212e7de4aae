"""Sequence parallelism (``model.params.sequence_parallel=true``, TP > 1) in the RL step.

Under megatron-core's SP each TP rank holds [S/TP, b, h] of the residual stream (widths are
rounded up to a multiple of TP); logits stay [S, b, V/TP]. Norm weights replicated over TP
see S/TP positions, so their grads are SUMMED over TP (:func:`allreduce_tp_partial_grads`);
the local spec's ``WrappedTorchNorm`` refuses SP (megatron-core 0.16.1
``transformer/torch_norm.py:32``), so :func:`local_block_spec` uses :class:`RMSNorm`.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from nemo_d3s.backends.megatron.main_weights import grad_of
from nemo_d3s.distributed.comm import is_single
from nemo_d3s.distributed.groups import ParallelGroups

__all__ = ["RMSNorm", "allreduce_tp_partial_grads", "local_block_spec"]


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built as megatron-core builds a norm, its weight marked
    ``sequence_parallel`` under SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(
                f"sequence_parallel.RMSNorm: the model's normalization is {config.normalization!r}"
            )
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def local_block_spec(config, *, pp_rank: int, vp_stage: Optional[int] = None):
    """The local GPT spec with :class:`RMSNorm` norms, as the ``TransformerBlockSubmodules``
    of stage ``pp_rank`` (chunk ``vp_stage``); same modules and parameter names."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    qk = bool(getattr(config, "qk_layernorm", False))
    experts = getattr(config, "num_moe_experts", None)
    layer = copy.deepcopy(
        get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm", qk_layernorm=qk)
    )
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if qk:  # WrappedTorchNorm refuses SP for the q/k norms too
        layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)


def allreduce_tp_partial_grads(
    chunks: List[torch.nn.Module], groups: ParallelGroups, *, qk_layernorm: bool = False
) -> int:
    """Sum over ``groups.tp`` the grads of TP-replicated params that saw a share of the work
    (``sequence_parallel``-marked; q / k norms with ``qk_layernorm``), as megatron-core's
    ``finalize_model_grads.py:353-355``; one all-reduce per dtype. Returns how many (TP 1: 0)."""
    if is_single(groups.tp):
        return 0
    grads: Dict[torch.dtype, List[torch.Tensor]] = {}
    for c in chunks:
        for name, p in c.named_parameters():
            partial = getattr(p, "sequence_parallel", False) or (
                qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            )
            g = grad_of(p) if p.requires_grad else None  # fp32 main_grad under MainWeightsAdamW
            if partial and g is not None:
                grads.setdefault(g.dtype, []).append(g)
    for dtype in sorted(grads, key=str):  # the same order on every rank
        gs = grads[dtype]
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.tp)
        offset = 0
        for g in gs:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return sum(len(v) for v in grads.values())
