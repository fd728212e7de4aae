"""How a rank's rows are cut into micro-batches: fixed row counts or a token budget.

A micro-batch costs rows x its longest row, so a budget sorts rows longest first and packs them
greedily, keeping a long-tailed length mix from padding every micro-batch. The gradient does not
depend on the partition (losses are sums over a global per-step denominator). Deterministic
functions of the [B] lengths (ties keep row order), so every rank of a model-parallel group makes
the same plan."""

from __future__ import annotations

from typing import List, Optional

import torch

from nemo_d3s.core.checks import check_count

__all__ = [
    "fixed_micro_batches",
    "plan_rows",
    "row_lengths",
    "token_budget_micro_batches",
]


def _check_lengths(lengths: torch.Tensor) -> None:
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be a [B] tensor, got shape {tuple(lengths.shape)}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("lengths must be >= 0")


def row_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool -> [B] long: 1 + each row's last attended column (0 for none), the width a row
    needs when fed alone."""
    S = attention_mask.shape[1]
    cols = torch.arange(1, S + 1).expand_as(attention_mask)
    return (
        (cols * attention_mask.bool()).amax(dim=1)
        if S
        else torch.zeros(len(attention_mask), dtype=torch.long)
    )


def fixed_micro_batches(num_rows: int, micro_batch_size: int) -> List[torch.Tensor]:
    """Consecutive runs of ``micro_batch_size`` rows (the last may be shorter); [] for none."""
    if (
        isinstance(micro_batch_size, bool)
        or not isinstance(micro_batch_size, int)
        or micro_batch_size < 1
    ):
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
    return list(torch.arange(num_rows).split(micro_batch_size)) if num_rows else []


def token_budget_micro_batches(lengths: torch.Tensor, max_tokens: int) -> List[torch.Tensor]:
    """lengths [B] long (CPU), max_tokens >= 1 -> [rows [n] long]: every row once, rows in
    descending length (ties in row order), micro-batches longest first, n x longest <= max_tokens
    unless n = 1. O(B log B)."""
    check_count("max_tokens", max_tokens, 1)
    _check_lengths(lengths)
    if lengths.numel() == 0:
        return []
    # stable sort on -length: equal lengths keep their row order (a deterministic plan)
    order = torch.sort(-lengths.long(), stable=True).indices
    sorted_len = lengths.long()[order].tolist()
    out: List[torch.Tensor] = []
    start = 0
    while start < len(order):
        width = max(sorted_len[start], 1)  # the first row is the longest: it sets the width
        n = max(1, min(len(order) - start, max_tokens // width))
        out.append(order[start : start + n])
        start += n
    return out


def plan_rows(
    lengths: torch.Tensor, micro_batch_size: int, max_tokens: Optional[int] = None
) -> List[torch.Tensor]:
    """:func:`token_budget_micro_batches` when ``max_tokens`` > 0, else
    :func:`fixed_micro_batches`."""
    if max_tokens:
        return token_budget_micro_batches(lengths, int(max_tokens))
    _check_lengths(lengths)
    return fixed_micro_batches(int(lengths.numel()), micro_batch_size)
