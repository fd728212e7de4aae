"""The dry run's sequence-length terms: tokens per micro-batch, micro-batches per step (which
cap 1F1B's in-flight count), interleaved 1F1B's extra activations, sequence parallelism's
share of the replicated activations, and when only (more) context parallelism would make a
layout fit.
"""

from __future__ import annotations

from typing import Dict, Optional

__all__ = [
    "context_parallel_need",
    "interleaving_factor",
    "micro_batches_per_step",
    "replicated_share",
    "tokens_per_micro_batch",
]


def tokens_per_micro_batch(rows: int, seq_len: int, budget: int = 0) -> int:
    """Most tokens one micro-batch feeds the model: ``rows x seq_len``; with a token budget
    > 0, ``max(budget, seq_len)`` (a row longer than the budget runs alone)."""
    if budget:
        return max(int(budget), int(seq_len))
    return int(rows) * int(seq_len)


def micro_batches_per_step(
    rows_per_dp: int, seq_len: int, micro_batch: int, budget: int = 0
) -> int:
    """Micro-batches per DP rank and optimizer step when every row is ``seq_len`` long:
    ``ceil(rows / micro_batch)``, or with a budget ``ceil(rows / max(1, budget // seq_len))``."""
    per = max(1, int(budget) // int(seq_len)) if budget else int(micro_batch)
    return -(-int(rows_per_dp) // per)


def interleaving_factor(pp: int, vpp: int) -> float:
    """First-stage activation memory of interleaved 1F1B relative to 1F1B: ``1 + (PP - 1) / (PP
    VPP)`` (Megatron-LM's ``theoretical_memory_usage``; Narayanan et al. 2021, sec. 2.2).
    """
    return 1.0 + (pp - 1) / (pp * vpp) if vpp > 1 and pp > 1 else 1.0


def replicated_share(tp: int, sequence_parallel: bool) -> float:
    """Share of the TP-replicated activations one rank stores: 1 / TP under SP, else 1."""
    return 1.0 / tp if sequence_parallel and tp > 1 else 1.0


def context_parallel_need(
    resident_bytes: float,
    minimal_training_bytes: float,
    gpu_bytes: float,
    *,
    seq_len: int,
    position: str,
) -> Optional[Dict[str, object]]:
    """None when one ``seq_len`` row with SP and full recompute fits beside the resident
    state; else the report entry naming the shortfall and what to do instead."""
    need = resident_bytes + minimal_training_bytes
    if need <= gpu_bytes:
        return None
    return {
        "position": position,
        "seq_len": int(seq_len),
        "minimal_training_peak_bytes": int(need),
        "message": (
            f"{position}: even one row of {seq_len} tokens per micro-batch with sequence "
            f"parallelism and full recompute needs {need / 1e9:.1f} GB; split the sequences "
            "over more GPUs with model.params.context_parallel_size (each then holds 1 / CP "
            "of a row), or shorten them"
        ),
    }
