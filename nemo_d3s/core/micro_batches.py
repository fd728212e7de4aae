"""How a rank's rows are cut into micro-batches: fixed row counts or a token budget.

A micro-batch of rows is fed to the model as one [b, L] block, L = its longest row, so it
costs b x L positions whatever its rows' own lengths; the difference is padding. With a
long-tailed length mix (most responses short, a few at the limit) fixed row counts put a
long row beside short ones in most micro-batches and pay its length for all of them.

- :func:`fixed_micro_batches`: consecutive runs of ``micro_batch_size`` rows (the layout
  the backends used before budgets; unchanged when no budget is set).
- :func:`token_budget_micro_batches`: rows sorted longest first, packed greedily: a
  micro-batch takes the next row while (rows + 1) x its first (longest) row's length stays
  within ``max_tokens``; a row longer than the budget gets a micro-batch of its own.
- :func:`plan_rows`: budget when > 0, else fixed; what the HF backend calls. (The Megatron
  backend calls the two above itself, in ``backends/megatron/batches.py``: it rounds row
  widths for sequence parallelism and pads for the interleaved schedule.)

Why the gradient does not change: the loss a backend hands the schedule is a SUM divided
by a global denominator counted once per optimizer step (``distributed.StepNormalizer``),
so any partition of the same rows gives the same gradient up to float summation order.

Pure functions of the [B] lengths; deterministic (ties keep row order), so every rank of
a model-parallel group, holding the same batch, makes the same plan.
"""

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
    """[B, S] bool -> [B] long: 1 + the last attended column of each row (0 for none), the
    width a row needs when fed alone (right padding after it is never fed)."""
    S = attention_mask.shape[1]
    cols = torch.arange(1, S + 1).expand_as(attention_mask)
    return (
        (cols * attention_mask.bool()).amax(dim=1)
        if S
        else torch.zeros(len(attention_mask), dtype=torch.long)
    )


def fixed_micro_batches(num_rows: int, micro_batch_size: int) -> List[torch.Tensor]:
    """[rows [n] long] = consecutive runs of ``micro_batch_size`` rows (the last may be
    shorter); [] for no rows."""
    if (
        isinstance(micro_batch_size, bool)
        or not isinstance(micro_batch_size, int)
        or micro_batch_size < 1
    ):
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
    return list(torch.arange(num_rows).split(micro_batch_size)) if num_rows else []


def token_budget_micro_batches(lengths: torch.Tensor, max_tokens: int) -> List[torch.Tensor]:
    """Partition rows by a token budget.

    lengths [B] long (CPU): the positions each row needs (its width when fed alone);
    max_tokens: the budget of fed positions (rows x longest row) per micro-batch, >= 1.
    -> [rows [n] long]: every row exactly once; rows of one micro-batch in descending
    length (ties in row order), micro-batches longest first; n x lengths[rows[0]] <=
    max_tokens unless n = 1 (a single row over the budget). O(B log B).
    """
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
    """``token_budget_micro_batches(lengths, max_tokens)`` when ``max_tokens`` > 0, else
    ``fixed_micro_batches(len(lengths), micro_batch_size)`` (the config's 0 / null)."""
    if max_tokens:
        return token_budget_micro_batches(lengths, int(max_tokens))
    _check_lengths(lengths)
    return fixed_micro_batches(int(lengths.numel()), micro_batch_size)
