"""The dry run's mixture-of-experts terms: what a GPU holds of the experts and what the
token dispatcher adds, and the report's MoE section (total vs active parameters).

- Expert parameters: E / EP experts per EP rank, each split over ETP, per pipeline stage;
  their gradients and optimizer state are those of any parameter, except that Megatron's
  distributed optimizer shards them over the expert-data-parallel group (world / (ETP EP
  PP)) instead of DP.
- Activations: a token passes through k experts of width F', so a MoE layer's MLP stores
  what a dense MLP of width k F' would (:func:`activation_spec`); the router's [T, E]
  logits are small beside it.
- Dispatcher buffers (:func:`dispatch_bytes`), T = the tokens of one micro-batch on this rank
  (T / TP under sequence parallelism), balanced routing, one layer at a time under full
  recompute, every layer of the stage without (megatron-core 0.16.1
  ``transformer/moe/token_dispatcher.py``):
  - ``alltoall``: the routed tokens [T k, H] permuted and received over EP, then all-gathered
    over the expert TP group (ETP T k: the experts' input, l.696-701) and the experts' output
    (ETP T k) reduce-scattered back (l.779): (2 + 2 ETP) T k rows of H;
  - ``allgather``: the tokens all-gathered over ETP x EP (l.274-276) and their unpermuted sum
    before the reduce-scatter back (l.338-339), 2 ETP EP T rows, and the local experts' input
    and output, ETP T k each: (2 ETP EP + 2 ETP k) T rows of H.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List

from nemo_d3s.backends.megatron.moe import check_moe_config
from nemo_d3s.backends.megatron.param_counts import local_param_count
from nemo_d3s.dry_run.memory import Workload
from nemo_d3s.dry_run.sequence import replicated_share

__all__ = [
    "activation_spec",
    "check_planned_moe",
    "dispatch_bytes",
    "expert_dp",
    "expert_params",
    "moe_summary",
]


def check_planned_moe(spec: Any, mcfg: Any) -> None:
    """The backend's MoE refusals (``moe.check_moe_layout``) for the backend config ``mcfg``, on
    CUDA (where ``distributed_optimizer=null`` means Megatron's)."""
    check_moe_config(
        spec,
        mcfg,
        packed=bool(mcfg.pack_sequences),
        distributed_optimizer=mcfg.distributed_optimizer is not False,
    )


def expert_dp(s: Any) -> int:
    """The expert-data-parallel size: world / (ETP x EP x PP)."""
    return s.shape.world // (s.etp * s.ep * s.pp)


def expert_params(s: Any, layout: Any) -> int:
    """The expert parameters of ``layout``'s position (0 for a dense model)."""
    return local_param_count(s.spec, layout, experts=True) if s.spec.num_experts else 0


def activation_spec(spec: Any) -> Any:
    """``spec`` as the activation model sees it: a MoE layer's MLP as a dense one of width
    k F' + Fs (the experts a token goes through, and a shared expert where there is one)."""
    if not spec.num_experts:
        return spec
    width = spec.moe_topk * spec.moe_ffn_hidden_size + spec.moe_shared_ffn_hidden_size
    return replace(spec, ffn_hidden_size=width)


def dispatch_bytes(
    spec: Any,
    w: Workload,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    etp: int = 1,
    dispatcher: str = "alltoall",
) -> float:
    """The dispatcher's routed-token buffers on one GPU (module docstring)."""
    if not spec.num_experts:
        return 0.0
    tokens = w.train_tokens * replicated_share(tp, w.sequence_parallel)
    k = spec.moe_topk
    if dispatcher == "allgather":
        rows = (2 * etp * ep + 2 * etp * k) * tokens
    else:
        rows = (2 + 2 * etp) * k * tokens
    layer = rows * spec.hidden_size * w.dtype_bytes
    return layer if w.recompute else layer * spec.num_layers // pp


def moe_summary(s: Any, positions: List[Dict[str, Any]], distributed_opt: bool) -> Dict[str, Any]:
    """The report's ``moe`` section: experts, EP / ETP / expert DP, total vs active
    parameters, and per GPU (the busiest position) the expert parameters, their optimizer
    state and the dispatcher's buffers."""
    spec = s.spec
    busiest = max(positions, key=lambda x: x["expert_params"])
    return {
        "experts": spec.num_experts,
        "topk": spec.moe_topk,
        "expert_ffn": spec.moe_ffn_hidden_size,
        "ep": s.ep,
        "etp": s.etp,
        "expert_dp": expert_dp(s),
        "dispatcher": str(s.mcfg.moe_token_dispatcher_type),
        "total_params": spec.num_params,
        "active_params": spec.active_params,
        "expert_params_per_gpu": busiest["expert_params"],
        "expert_optimizer_bytes_per_gpu": busiest["expert_optimizer_bytes"],
        "dispatch_buffer_bytes": busiest["terms_bytes"].get("moe_dispatch", 0),
        "expert_optimizer_sharded_over": "expert DP" if distributed_opt else "nothing",
    }
