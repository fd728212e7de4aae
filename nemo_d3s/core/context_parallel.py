"""Context parallelism's chunking: every sequence (a row, or a pack's slot) cut into 2 x CP
chunks, CP rank r holding chunks r and 2 CP - 1 - r (balanced causal work), first then
second: megatron-core's and Transformer Engine's order (megatron-core 0.16.1
models/common/embeddings/rope_utils.py:129-175)."""

from __future__ import annotations

from typing import List

import torch

__all__ = ["zigzag_positions", "all_zigzag_positions"]


def zigzag_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[T / CP] long: the global positions rank ``cp_rank`` holds, in local order, of the
    sequences ``cu_seqlens`` [n + 1] bounds (each a multiple of 2 x CP long)."""
    cu = cu_seqlens.long().cpu()
    lengths = cu[1:] - cu[:-1]
    if bool((lengths % (2 * cp_size)).any()):
        raise ValueError(
            f"context parallelism {cp_size}: every sequence's length must be a multiple of "
            f"{2 * cp_size}, got {lengths.tolist()}"
        )
    chunk = lengths // (2 * cp_size)
    parts: List[torch.Tensor] = []
    for start, c in zip(cu[:-1].tolist(), chunk.tolist()):
        parts.append(torch.arange(start + cp_rank * c, start + (cp_rank + 1) * c))
        late = 2 * cp_size - 1 - cp_rank
        parts.append(torch.arange(start + late * c, start + (late + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def all_zigzag_positions(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[T] long: every rank's :func:`zigzag_positions`, in all-gather order."""
    return torch.cat([zigzag_positions(cu_seqlens, cp_size, r) for r in range(cp_size)])
