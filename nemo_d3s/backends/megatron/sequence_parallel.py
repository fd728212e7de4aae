"""Sequence parallelism (``model.params.sequence_parallel=true``, TP > 1) in the RL step.

What megatron-core does under ``TransformerConfig.sequence_parallel`` (0.16.1), and what
this module adds so that the backend's own paths agree with it:

- Activations outside the tensor-parallel matmuls ([S, b, h] residual stream, layer norms,
  dropout) are split along the sequence: each TP rank holds [S/TP, b, h]. The embedding
  reduce-scatters its output (``language_model_embedding.py:47-52`` and
  ``VocabParallelEmbedding(reduce_scatter_embeddings=True)``), every column-parallel linear
  all-gathers its input along the sequence and every row-parallel linear reduce-scatters
  its output (``tensor_parallel/layers.py`` ``_forward_impl(sequence_parallel=...)``). The
  sequence length must divide by TP: the micro-batch plan rounds widths up to a multiple
  of TP (``batches.plan_micro_batches(multiple_of=TP)``; padded positions are not
  attended by any real token under the causal mask and are never scored).
- The output layer is a ``ColumnParallelLinear`` with ``sequence_parallel`` set, so it
  all-gathers the final hidden states back to the whole sequence before the vocabulary
  matmul (``gpt_model.py:683`` ``self.output_layer(hidden_states, ...)``): logits are
  [S, b, V/TP] as without SP, and the fused vocab-parallel log-prob / entropy kernel on the
  last stage runs unchanged.
- Parameters that SP leaves replicated over TP but that see only S/TP positions per rank
  (the layer norms) get a partial gradient on each TP rank; it must be SUMMED over TP.
  megatron-core's ``finalize_model_grads`` does it for its DDP
  (``distributed/finalize_model_grads.py:318-393``: params with ``sequence_parallel``
  set, one coalesced all-reduce SUM on the TP group); :func:`allreduce_tp_partial_grads`
  is the same for plain ``.grad`` tensors (the backend's CPU optimizer path), and also
  sums the q / k norms of ``qk_layernorm`` models (Qwen3), which need it at any TP > 1.
- megatron-core's local layer spec builds its norms with ``WrappedTorchNorm``, which
  refuses SP (``transformer/torch_norm.py:32``; Apex's ``FusedLayerNorm`` and TE's
  ``TENorm`` accept it and mark their weights ``sequence_parallel``; on CUDA with TE the
  norms are fused into the following linear, whose ``layer_norm_weight`` TE marks in
  ``reset_parameters``: ``transformer_engine/pytorch/module/layernorm_linear.py`` and
  ``layernorm_mlp.py``, ``setattr(self.layer_norm_weight, "sequence_parallel", ...)``;
  not run here: no GPU).
  :func:`local_block_spec` is the local spec with :class:`RMSNorm` instead, torch's RMSNorm
  whose weight carries that mark: same parameters, same names, same math per position.

Memory: each TP rank keeps [S/TP, b, h] of every layer's residual-stream activations
instead of [S, b, h] (the dry run's ``sequence_parallel`` term); the all-gathered inputs of
the linear layers are transient.
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
    """torch's RMSNorm built the way megatron-core builds a norm (``config, hidden_size,
    eps``); its weight is marked ``sequence_parallel`` when the config says so (what
    ``finalize_model_grads`` and :func:`allreduce_tp_partial_grads` look for)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(
                f"sequence_parallel.RMSNorm: the model's normalization is {config.normalization!r}"
            )
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def local_block_spec(config, *, pp_rank: int, vp_stage: Optional[int] = None):
    """megatron-core's local GPT layer spec (RMSNorm) with :class:`RMSNorm` for the two
    per-layer norms and the final norm, as the ``TransformerBlockSubmodules`` of the
    ``pp_rank`` stage's layers (of its chunk ``vp_stage`` with a virtual pipeline);
    ``GPTModel`` takes either form; the block builds the same modules and parameter names
    as from the single layer spec."""
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
    """Sum over ``groups.tp`` the ``.grad`` of every parameter that is replicated over TP but
    sees only this rank's share of the work: those marked ``sequence_parallel`` (layer norms
    under SP: S/TP positions) and, with ``qk_layernorm``, the q / k norms (Qwen3: this rank's
    heads only, with or without SP). The same rule as megatron-core's
    ``_allreduce_non_tensor_model_parallel_grads`` for its DDP buffers
    (``distributed/finalize_model_grads.py:353-355``: the ``sequence_parallel`` mark, or a
    name holding q_layernorm / k_layernorm when ``config.qk_layernorm``), one flat all-reduce
    per dtype. Returns the number of tensors reduced (0, and no collective, at TP 1 or
    without such params). Collective over ``groups.tp``; every TP rank holds the same ones."""
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
