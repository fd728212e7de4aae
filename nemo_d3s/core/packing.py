"""Packed micro-batches (THD): rows laid end to end in one row of T positions.

Slot i, ``[cu[i], cu[i+1])``, holds row i's real tokens then padding (to a multiple of
``seq_multiple``; the last slot also to T). Attention stays causal within a slot and
positions restart in each, so every real token's output is the one it has alone. Outputs
are token-aligned as for rows; :meth:`PackedMicroBatch.unpack` gives each row's column 0
the contract's 0 (the pack scored it from the previous slot). :func:`pack_micro_batches`:
first-fit decreasing's number of packs, rows then spread over them evenly; deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Tuple

import torch

from nemo_d3s.core.checks import check_count

__all__ = ["PackedMicroBatch", "empty_pack", "pack_micro_batches", "slot_lengths"]


@dataclass(frozen=True)
class PackedMicroBatch:
    """rows [n], lengths [n] (real tokens, a prefix of each row), cu_seqlens [max(n, 1) + 1]
    slot boundaries, cu[-1] = T (no rows: one slot of padding); all long."""

    rows: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def width(self) -> int:
        """T: positions fed to the model."""
        return int(self.cu_seqlens[-1])

    @property
    def max_seqlen(self) -> int:
        """The longest slot (``PackedSeqParams.max_seqlen_q``)."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def widen(self, width: int) -> "PackedMicroBatch":
        """The pack fed at ``width`` >= its content (the last slot grows)."""
        need = int(self.cu_seqlens[-2]) + max(int(self.lengths[-1]) if len(self.rows) else 0, 1)
        if int(width) < need:
            raise ValueError(f"width {width} < the pack's content ({need} positions)")
        cu = self.cu_seqlens.clone()
        cu[-1] = int(width)
        return replace(self, cu_seqlens=cu)

    def position_ids(self) -> torch.Tensor:
        """[T] long: the position of each packed token within its slot (restarts at 0)."""
        cu = self.cu_seqlens
        starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
        return torch.arange(self.width) - starts

    def segment_ids(self) -> torch.Tensor:
        """[T] long: the slot of each packed position."""
        cu = self.cu_seqlens
        return torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])

    def tokens(self, first=0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row in pack, column, packed position), [N] each, of every real token at a column
        >= ``first`` (int or [n]) of its row."""
        first = torch.as_tensor(first, dtype=torch.long).expand(len(self.rows))
        counts = (self.lengths - first).clamp(min=0)
        r = torch.repeat_interleave(torch.arange(len(self.rows)), counts)
        offsets = torch.cumsum(counts, 0) - counts
        c = torch.arange(int(counts.sum())) - offsets[r] + first[r]
        return r, c, self.cu_seqlens[:-1][r] + c

    def pack(self, x: torch.Tensor, value=0) -> torch.Tensor:
        """x [B, S, ...] -> [T, ...]: the rows' real tokens in their slots, ``value``
        elsewhere."""
        r, c, p = self.tokens(0)
        out = x.new_full((self.width, *x.shape[2:]), value)
        out[p] = x[self.rows[r], c]
        return out

    def unpack(self, y: torch.Tensor, width: int) -> torch.Tensor:
        """Token-aligned y [T, ...] -> [n, width, ...], differentiable: columns 1..l_i - 1
        from the slot, 0 elsewhere."""
        r, c, p = self.tokens(1)
        keep = c < width
        out = y.new_zeros((len(self.rows), width, *y.shape[1:]))
        return out.index_put((r[keep], c[keep]), y[p[keep]])


def slot_lengths(lengths: torch.Tensor, seq_multiple: int = 1) -> torch.Tensor:
    """[B] long: each row's slot, its length (>= 1) rounded up to ``seq_multiple``."""
    m = int(seq_multiple)
    return (lengths.long().clamp(min=1) + m - 1) // m * m


def pack_micro_batches(
    lengths: torch.Tensor, max_tokens: int, *, seq_multiple: int = 1
) -> List[PackedMicroBatch]:
    """Rows of [B] ``lengths`` (CPU long) in packs of <= ``max_tokens`` positions (a longer
    slot alone): n = first-fit decreasing's pack count, then rows longest first into the
    least loaded of n packs when that keeps the budget and first-fit's fullest pack. Width =
    content; every row once. O(B n)."""
    check_count("max_tokens", max_tokens, 1)
    check_count("seq_multiple", seq_multiple, 1)
    if lengths.dim() != 1 or (lengths.numel() and int(lengths.min()) < 0):
        raise ValueError(f"lengths must be a [B] tensor of counts >= 0, got {lengths}")
    slots = slot_lengths(lengths, seq_multiple)
    order = torch.sort(-slots, stable=True).indices.tolist()
    sizes = slots.tolist()
    room: List[int] = []
    members: List[List[int]] = []
    for row in order:  # first-fit decreasing
        for k, left in enumerate(room):
            if left >= sizes[row]:
                room[k] -= sizes[row]
                members[k].append(row)
                break
        else:
            room.append(max(int(max_tokens), sizes[row]) - sizes[row])
            members.append([row])
    fullest = max((sum(sizes[r] for r in m) for m in members), default=0)
    load = [0] * len(members)
    spread: List[List[int]] = [[] for _ in members]
    for row in order:  # longest processing time first, over the same number of packs
        k = load.index(min(load))
        load[k] += sizes[row]
        spread[k].append(row)
    shared_fit = all(n <= max_tokens for n, m in zip(load, spread) if len(m) > 1)
    if shared_fit and max(load, default=0) <= fullest:
        members = spread
    out = []
    for rows in members:
        idx = torch.tensor(rows, dtype=torch.long)
        cu = torch.zeros(len(rows) + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(slots[idx], 0)
        out.append(PackedMicroBatch(idx, lengths.long()[idx], cu))
    return out


def empty_pack(width: int) -> PackedMicroBatch:
    """The zero-weight pack of a rank without rows: ``width`` padding positions."""
    none = torch.zeros(0, dtype=torch.long)
    return PackedMicroBatch(none, none, torch.tensor([0, int(width)], dtype=torch.long))
