"""Megatron's process groups for a rank: the one place outside tests that calls
``parallel_state.initialize_model_parallel`` for gloo/CPU launches (the test and benchmark
rank launchers hand this to ``nemo_d3s.distributed.run_on_gloo_ranks`` as ``rank_setup``)."""

from __future__ import annotations

import os
import warnings
from typing import Callable, List, Optional

__all__ = [
    "DEFAULT_ORDER",
    "TP_PP_DP_ORDER",
    "first_ranks_of_model_copies",
    "global_rank_of",
    "initialize_megatron_groups",
    "rank_order",
    "set_cuda_connections",
]


DEFAULT_ORDER, TP_PP_DP_ORDER = "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"


def rank_order(use_tp_pp_dp_mapping: bool) -> str:
    """Megatron's ``order`` for its ``use_tp_pp_dp_mapping`` flag."""
    return TP_PP_DP_ORDER if use_tp_pp_dp_mapping else DEFAULT_ORDER


def global_rank_of(
    tp_rank: int,
    pp_rank: int,
    dp_rank: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    order: str = DEFAULT_ORDER,
) -> int:
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


def set_cuda_connections() -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless the user set it (one hardware work queue:
    kernels start in the order they are queued, which Megatron's tensor-parallel layers rely
    on to overlap their all-gathers and reduce-scatters with compute: megatron-core 0.16.1
    ``tensor_parallel/layers.py:526-558``). The CUDA driver reads it when a context is
    created, so call this before anything touches CUDA (``torch.cuda.set_device``, the first
    CUDA tensor). Called too late (CUDA already initialised, the variable unset), it warns:
    the value cannot reach the existing context."""
    import torch

    if "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        warnings.warn(
            "CUDA was initialised before CUDA_DEVICE_MAX_CONNECTIONS=1 was set: it does "
            "not apply to this process; export it before starting Python (slurm/*.sbatch "
            "do)",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


def initialize_megatron_groups(
    rank: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    order: str = DEFAULT_ORDER,
    vpp: Optional[int] = None,
) -> Callable[[], None]:
    """Build Megatron's TP/PP/CP/DP groups (DP = world / (tp pp cp)) on the process group
    that exists, ranks laid out in ``order``, with a virtual pipeline of ``vpp`` chunks per
    stage when vpp > 1 (interleaved 1F1B); returns the teardown (``destroy_model_parallel``).
    ``rank`` is unused (the ``rank_setup`` signature)."""
    set_cuda_connections()  # (a no-op when the backend or the launcher set it first)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        order=order,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
    )
    return ps.destroy_model_parallel
