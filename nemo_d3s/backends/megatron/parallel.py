"""Megatron's process groups for a rank: the one place outside tests that calls
``parallel_state.initialize_model_parallel`` for gloo/CPU launches (the test and benchmark
rank launchers hand this to ``nemo_d3s.distributed.run_on_gloo_ranks`` as ``rank_setup``)."""

from __future__ import annotations

import os
import warnings
from typing import Callable

__all__ = ["initialize_megatron_groups"]


def initialize_megatron_groups(rank: int, tp: int = 1, pp: int = 1, cp: int = 1) -> Callable[[], None]:
    """Build Megatron's TP/PP/CP/DP groups (DP = world / (tp pp cp)) on the process group
    that exists; returns the teardown (``destroy_model_parallel``). ``rank`` is unused (the
    ``rank_setup`` signature)."""
    # Megatron warns about this GPU-only setting on every linear layer; 1 is what TP needs.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    return ps.destroy_model_parallel
