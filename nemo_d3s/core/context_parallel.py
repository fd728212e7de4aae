"""Context parallelism's one chunking: which positions of a sequence each CP rank holds.

Every sequence (a row of S positions, or each slot of a pack's ``cu_seqlens``) is cut into
2 x CP equal chunks and CP rank r holds chunks r and 2 CP - 1 - r, in that order: under
causal attention the early chunks attend to little and the late ones to much, so each
rank gets one of each and the same work (megatron-core's ``get_batch_on_this_cp_rank`` and
``_get_thd_freqs_on_this_cp_rank``, Transformer Engine's ``thd_get_partitioned_indices``;
megatron-core 0.16.1 models/common/embeddings/rope_utils.py:129-175). A rank's local tensor
holds its positions slot by slot, first chunk then second.
"""

from __future__ import annotations

from typing import List

import torch

__all__ = ["zigzag_positions", "all_zigzag_positions"]


def zigzag_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[T / CP] long: the global positions CP rank ``cp_rank`` holds, in its local order.
    cu_seqlens [n + 1]: the sequences' boundaries (one sequence of S: [0, S]); every
    sequence's length a multiple of 2 x CP (ValueError otherwise)."""
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
    """[T] long: every rank's :func:`zigzag_positions`, rank by rank (the order of an
    all-gather over the CP group)."""
    return torch.cat([zigzag_positions(cu_seqlens, cp_size, r) for r in range(cp_size)])
