"""Megatron's process groups for a rank: the one place outside tests that calls
``parallel_state.initialize_model_parallel`` for gloo/CPU launches (the test and benchmark
rank launchers hand this to ``nemo_d3s.distributed.run_on_gloo_ranks`` as ``rank_setup``)."""

from __future__ import annotations

import os
import warnings
from typing import Callable, List, Optional

__all__ = ["DEFAULT_ORDER", "TP_PP_DP_ORDER", "first_ranks_of_model_copies", "global_rank_of",
           "initialize_megatron_groups", "rank_order"]


DEFAULT_ORDER, TP_PP_DP_ORDER = "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"


def rank_order(use_tp_pp_dp_mapping: bool) -> str:
    """Megatron's ``order`` for its ``use_tp_pp_dp_mapping`` flag."""
    return TP_PP_DP_ORDER if use_tp_pp_dp_mapping else DEFAULT_ORDER


def global_rank_of(tp_rank: int, pp_rank: int, dp_rank: int, *, tp: int, pp: int, dp: int,
                   order: str = DEFAULT_ORDER) -> int:
    """The global rank Megatron gives a (TP, PP, DP) position (no CP / EP)."""
    if order == DEFAULT_ORDER:
        return tp_rank + tp * (dp_rank + dp * pp_rank)
    if order == TP_PP_DP_ORDER:
        return tp_rank + tp * (pp_rank + pp * dp_rank)
    raise ValueError(f"rank order {order!r}: only {DEFAULT_ORDER} and {TP_PP_DP_ORDER}")


def first_ranks_of_model_copies(tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER) -> List[int]:
    """Global rank of (TP rank 0, stage 0) of each DP replica's TP x PP copy, replica order
    (where the rollout engines start): tp-cp-ep-dp-pp interleaves the replicas' first stages
    (stride TP), tp-cp-ep-pp-dp keeps each copy on consecutive ranks (stride TP x PP)."""
    return [global_rank_of(0, 0, k, tp=tp, pp=pp, dp=dp, order=order) for k in range(dp)]


def initialize_megatron_groups(rank: int, tp: int = 1, pp: int = 1, cp: int = 1,
                               order: str = DEFAULT_ORDER, vpp: Optional[int] = None) -> Callable[[], None]:
    """Build Megatron's TP/PP/CP/DP groups (DP = world / (tp pp cp)) on the process group
    that exists, ranks laid out in ``order``, with a virtual pipeline of ``vpp`` chunks per
    stage when vpp > 1 (interleaved 1F1B); returns the teardown (``destroy_model_parallel``).
    ``rank`` is unused (the ``rank_setup`` signature)."""
    # Megatron warns about this GPU-only setting on every linear layer; 1 is what TP needs.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp, order=order,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
    )
    return ps.destroy_model_parallel
