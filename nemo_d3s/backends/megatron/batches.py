"""Micro-batches of the Megatron backend's schedules: which rows of a right-padded [B, S]
batch, how many, how wide, or packed into [1, T] rows (THD, ``core.packing``). Pure CPU
bookkeeping: no collective, no Megatron import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from nemo_d3s.backends.base import TokenBatch
from nemo_d3s.core.micro_batches import fixed_micro_batches, row_lengths, token_budget_micro_batches
from nemo_d3s.core.packing import PackedMicroBatch, empty_pack, pack_micro_batches
from nemo_d3s.distributed.pipeline import fit_width

__all__ = [
    "MicroBatch",
    "model_inputs",
    "pad_for_interleaving",
    "plan_micro_batches",
    "plan_packed",
    "token_counts",
    "width_multiple",
]


@dataclass(frozen=True)
class MicroBatch:
    """rows [n] long (CPU) fed as b >= n rows (dummy rows after them) of ``width`` L, or
    ``pack``: the rows packed into one row of L positions (b = 1)."""

    rows: torch.Tensor
    b: int
    width: int
    pack: Optional[PackedMicroBatch] = None


def _check_right_padded(mask: torch.Tensor) -> None:
    # The model sees only a causal mask, so every row's real tokens must form a prefix.
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask must be right-padded (each row's real tokens a prefix of the row)"
        )


def _real_length(mask: torch.Tensor) -> int:
    cols = mask.any(dim=0).nonzero()
    return int(cols[-1]) + 1 if cols.numel() else 0


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def width_multiple(multiple_of: int = 1, quantum: int = 0) -> int:
    """Widths are multiples of ``multiple_of`` (TP under SP) and ``quantum`` (0: none)."""
    return math.lcm(int(multiple_of), int(quantum)) if quantum else int(multiple_of)


def plan_micro_batches(
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    *,
    uniform: bool,
    multiple_of: int = 1,
    max_tokens: int = 0,
    quantum: int = 0,
) -> List[MicroBatch]:
    """Micro-batches of <= ``micro_batch_size`` consecutive rows of a right-padded [B, S]
    mask, or (``max_tokens`` > 0) rows packed to b x L <= that budget, longest first.

    ``uniform`` (PP > 1, fixed rows): one shape per call, dummy rows fill the last one.
    Widths >= 2, rounded up to :func:`width_multiple` (``multiple_of``, ``quantum``). B = 0
    gives one zero-weight dummy-row micro-batch, so a rank without data still joins every
    collective.
    """
    if (
        isinstance(micro_batch_size, bool)
        or not isinstance(micro_batch_size, int)
        or micro_batch_size < 1
    ):
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
    m = width_multiple(multiple_of, quantum)
    B = attention_mask.shape[0]
    if B == 0:
        return [MicroBatch(torch.zeros(0, dtype=torch.long), 1, _round_up(2, m))]
    _check_right_padded(attention_mask)
    if max_tokens:
        widths = row_lengths(attention_mask).clamp(min=2)
        widths = (widths + m - 1) // m * m
        return [
            MicroBatch(r, len(r), int(widths[r[0]]))
            for r in token_budget_micro_batches(widths, int(max_tokens))
        ]
    chunks = fixed_micro_batches(B, micro_batch_size)
    if uniform:
        width = _round_up(max(_real_length(attention_mask), 2), m)
        return [MicroBatch(r, micro_batch_size, width) for r in chunks]
    return [
        MicroBatch(r, len(r), _round_up(max(_real_length(attention_mask[r]), 2), m)) for r in chunks
    ]


def plan_packed(
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    max_tokens: int,
    *,
    multiple_of: int = 1,
    seq_multiple: int = 1,
    quantum: int = 0,
) -> List[MicroBatch]:
    """Packs (``core.packing``) of a right-padded [B, S] mask under ``max_tokens``, or (0)
    ``micro_batch_size`` longest rows', slots multiples of ``seq_multiple``; one width per
    call (the fullest pack within the budget, >= 2, to :func:`width_multiple`), but a row
    longer than the budget is a pack at its own width, and only that pack is that wide (had
    every pack been widened to it, each would feed the padding as part of its last slot, with
    quadratic attention over it: one 32k row among 2k rows at a budget of 8k tripled the
    positions fed). B = 0: one zero-weight pack."""
    m = width_multiple(multiple_of, quantum)
    B = attention_mask.shape[0]
    if B == 0:
        w = _round_up(2, m)
        return [MicroBatch(torch.zeros(0, dtype=torch.long), 1, w, empty_pack(w))]
    _check_right_padded(attention_mask)
    lengths = row_lengths(attention_mask)
    budget = max_tokens or micro_batch_size * max(int(lengths.max()), 1)
    packs = pack_micro_batches(lengths, budget, seq_multiple=seq_multiple)
    w = _round_up(max(max((p.width for p in packs if p.width <= budget), default=0), 2), m)
    widths = [max(w, _round_up(p.width, m)) for p in packs]
    return [MicroBatch(p.rows, 1, width, p.widen(width)) for p, width in zip(packs, widths)]


def pad_for_interleaving(
    mbs: List[MicroBatch], pp: int, *, one_shape: bool = False
) -> List[MicroBatch]:
    """Append zero-weight micro-batches (the first one's shape) up to a multiple of PP, as
    interleaved 1F1B needs (megatron-core 0.16.1 schedules.py:993-1010); ``one_shape``:
    widen all to the plan's largest rows x width."""
    if one_shape:
        b, width = max(m.b for m in mbs), max(m.width for m in mbs)
        mbs = [
            MicroBatch(m.rows, b, width, None if m.pack is None else m.pack.widen(width))
            for m in mbs
        ]
    target = max(_round_up(len(mbs), pp), pp)
    first = mbs[0]
    pad = MicroBatch(
        torch.zeros(0, dtype=torch.long),
        first.b,
        first.width,
        empty_pack(first.width) if first.pack else None,
    )
    return list(mbs) + [pad] * (target - len(mbs))


def model_inputs(batch: TokenBatch, mb: MicroBatch, device: torch.device):
    """(input_ids, position_ids [b, L] long, mask, attended [n, L] bool, pack) on ``device``;
    mask: causal [1, 1, L, L] (True = masked) on CPU, None on CUDA (the kernels build it). A
    pack: ids and positions (restarting per row) [1, L], no mask and attended None."""
    if mb.pack is not None:
        ids = mb.pack.pack(batch.input_ids).unsqueeze(0).to(device)
        return ids, mb.pack.position_ids().unsqueeze(0).to(device), None, None, mb.pack
    ids = fit_width(batch.input_ids[mb.rows], mb.width)
    if mb.b > ids.shape[0]:  # dummy rows: token 0, never read back
        ids = torch.cat([ids, ids.new_zeros(mb.b - ids.shape[0], mb.width)])
    attended = fit_width(batch.attention_mask[mb.rows].bool(), mb.width, value=False)
    pos = torch.arange(mb.width).unsqueeze(0).expand(mb.b, -1)
    mask = None
    if device.type != "cuda":
        mask = (
            torch.ones(mb.width, mb.width, dtype=torch.bool, device=device)
            .triu_(1)
            .view(1, 1, mb.width, mb.width)
        )
    return ids.to(device), pos.to(device), mask, attended.to(device), None


def token_counts(batch: TokenBatch, mbs: List[MicroBatch]) -> Dict[str, float]:
    """fed_tokens (b x L summed, padding included) and attended_tokens (real tokens)."""
    return {
        "fed_tokens": float(sum(m.b * m.width for m in mbs)),
        "attended_tokens": float(batch.attention_mask.sum()),
    }
