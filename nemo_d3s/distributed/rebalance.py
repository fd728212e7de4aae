"""Move kept rollouts between data-parallel ranks so every rank trains on about as many tokens (a
step takes as long as its most loaded rank).

Every rank all-gathers (tokens, keep) and computes the same greedy longest-first (LPT) plan: kept
samples by tokens descending go to the rank with the least (tokens, samples, rank), so no rank is
empty when n >= world; when 0 < n < world an empty rank gets a zero-weight copy of sample 0 so its
schedule runs. One ``all_to_all`` applies the plan. With a global loss denominator a sample's
contribution does not depend on its rank: the gradient is unchanged."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_d3s.distributed.comm import all_gather_varlen, group_rank, group_size, is_single

__all__ = [
    "RebalancePlan",
    "RebalancedBatch",
    "plan_rebalance",
    "plan_from_tokens",
    "apply_rebalance",
    "imbalance",
]


def imbalance(tokens_per_rank: torch.Tensor) -> float:
    """max / mean of the tokens per rank (1.0 = perfectly balanced; 1.0 when all are 0)."""
    total = float(tokens_per_rank.sum())
    if total == 0:
        return 1.0
    return float(tokens_per_rank.max()) * tokens_per_rank.numel() / total


@dataclass
class RebalancePlan:
    """Which kept sample (j = 0..n-1, global order) goes to which rank; identical on every rank.
    owner, source_row, tokens, dest [n] long; pad_source [world] (-1 or the j copied as a pad);
    rows_per_rank [world]; tokens before / after [world] and their imbalance."""

    world_size: int
    owner: torch.Tensor
    source_row: torch.Tensor
    tokens: torch.Tensor
    dest: torch.Tensor
    pad_source: torch.Tensor
    rows_per_rank: torch.Tensor
    tokens_before: torch.Tensor = field(init=False)
    tokens_after: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        w = self.world_size
        self.tokens_before = torch.zeros(w, dtype=torch.long).index_add_(0, self.owner, self.tokens)
        self.tokens_after = torch.zeros(w, dtype=torch.long).index_add_(0, self.dest, self.tokens)

    @property
    def n_kept(self) -> int:
        return int(self.owner.numel())

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.tokens_before)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.tokens_after)

    def samples_of(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(j [m] long ascending, weight [m] f32) that ``rank`` trains on after the move."""
        js = (self.dest == rank).nonzero().flatten()
        weights = torch.ones(js.numel(), dtype=torch.float32)
        pad = int(self.pad_source[rank])
        if pad >= 0:  # only ever on a rank without real samples
            return torch.tensor([pad]), torch.zeros(1)
        return js, weights

    def _sends(self, src: int, dst: int) -> torch.Tensor:
        """Rows of ``src`` going to ``dst``, in the order ``dst`` stores them (ascending j)."""
        js, _ = self.samples_of(dst)
        js = js[self.owner[js] == src]
        return self.source_row[js]


def plan_from_tokens(
    tokens: torch.Tensor,
    owner: torch.Tensor,
    source_row: torch.Tensor,
    world_size: int,
    rows_per_rank: torch.Tensor,
) -> RebalancePlan:
    """LPT plan, no collective: tokens, owner, source_row [n] of the kept samples -> RebalancePlan.
    O(n log n + n log world)."""
    n = int(tokens.numel())
    t = tokens.tolist()
    dest = [0] * n
    # (load, samples, rank): the sample count breaks load ties so zero-token samples still
    # spread over empty ranks, and the rank index makes the choice deterministic.
    heap = [(0, 0, r) for r in range(world_size)]
    for j in sorted(range(n), key=lambda i: (-t[i], i)):
        load, cnt, r = heapq.heappop(heap)
        dest[j] = r
        heapq.heappush(heap, (load + t[j], cnt + 1, r))
    dest_t = torch.tensor(dest, dtype=torch.long)
    pad_source = torch.full((world_size,), -1, dtype=torch.long)
    if 0 < n < world_size:
        empty = torch.ones(world_size, dtype=torch.bool)
        empty[dest_t] = False
        pad_source[empty] = 0
    return RebalancePlan(
        world_size,
        owner.long(),
        source_row.long(),
        tokens.long(),
        dest_t,
        pad_source,
        rows_per_rank,
    )


def plan_rebalance(
    n_tokens: torch.Tensor,
    sample_keep: Optional[torch.Tensor],
    dp_group: Optional[dist.ProcessGroup],
) -> RebalancePlan:
    """Plan this step's move identically on every rank: n_tokens [B_r] (each sample's load),
    sample_keep [B_r] bool or None (all). Collectives on ``dp_group``: an all-gather of one int64
    and one of [max_r B_r, 2] int64."""
    if (
        not isinstance(n_tokens, torch.Tensor)
        or n_tokens.dim() != 1
        or n_tokens.is_floating_point()
    ):
        got = getattr(n_tokens, "dtype", type(n_tokens).__name__)
        raise ValueError(f"n_tokens must be a 1-D integer tensor [B], got {got}")
    if sample_keep is None:
        sample_keep = torch.ones_like(n_tokens, dtype=torch.bool)
    if sample_keep.dtype != torch.bool or sample_keep.shape != n_tokens.shape:
        raise ValueError(
            f"sample_keep must be a bool tensor of shape {tuple(n_tokens.shape)}, "
            f"got {sample_keep.dtype} {tuple(sample_keep.shape)}"
        )
    if n_tokens.numel() and int(n_tokens.min()) < 0:
        raise ValueError(f"n_tokens must be >= 0, found {int(n_tokens.min())}")
    packed = torch.stack([n_tokens.long(), sample_keep.long()], 1)
    everything, counts = all_gather_varlen(packed, dp_group)
    everything, counts = everything.cpu(), counts.cpu()
    rank_of_row = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    row_on_rank = (
        torch.arange(everything.shape[0]) - (torch.cumsum(counts, 0) - counts)[rank_of_row]
    )
    kept = everything[:, 1].bool()
    return plan_from_tokens(
        everything[kept, 0], rank_of_row[kept], row_on_rank[kept], group_size(dp_group), counts
    )


@dataclass
class RebalancedBatch:
    """tensors: name -> [m, ...] rows this rank trains on (ascending j); weight [m] f32
    (0 for a pad); sample_index [m] (j); is_pad [m] bool."""

    tensors: Dict[str, torch.Tensor]
    weight: torch.Tensor
    sample_index: torch.Tensor
    is_pad: torch.Tensor


def _row_bytes(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] any dtype -> [B, bytes per row] uint8 view (a copy only if non-contiguous)."""
    row = int(torch.tensor(x.shape[1:]).prod()) if x.dim() > 1 else 1
    if x.shape[0] == 0 or row == 0:
        # An empty view has stride 0, which a dtype view rejects: a rank with no rows (the
        # very case rebalancing exists for) sends nothing.
        return torch.zeros((x.shape[0], row * x.element_size()), dtype=torch.uint8, device=x.device)
    return x.contiguous().reshape(x.shape[0], row).view(torch.uint8)


def apply_rebalance(
    plan: RebalancePlan,
    tensors: Mapping[str, torch.Tensor],
    dp_group: Optional[dist.ProcessGroup],
    *,
    zero_on_pad: Sequence[str] = (),
) -> RebalancedBatch:
    """Send every kept sample to its planned rank: tensors name -> [B_r, ...] (same names, trailing
    shapes and dtypes on every rank) -> this rank's RebalancedBatch, ``zero_on_pad`` rows zeroed for
    pads. Collectives: an all-gather of metadata (a mismatch raises on every rank) and ONE
    ``all_to_all_single`` of rows packed as bytes. Memory: one packed copy of the local rows plus
    the received ones."""
    me = group_rank(dp_group)
    names = sorted(tensors)
    meta = [(n, tuple(tensors[n].shape), str(tensors[n].dtype)) for n in names]
    if is_single(dp_group):
        everyone = [meta]
    else:
        everyone = [None] * group_size(dp_group)
        dist.all_gather_object(everyone, meta, group=dp_group)
    for r, m in enumerate(everyone):
        if [(n, s[1:], d) for n, s, d in m] != [(n, s[1:], d) for n, s, d in meta]:
            raise ValueError(
                f"apply_rebalance: rank {r} passes tensors {m}, rank {me} passes {meta}; "
                "names, trailing shapes and dtypes must match"
            )
        if any(s[0] != int(plan.rows_per_rank[r]) for _, s, _ in m):
            raise ValueError(
                f"apply_rebalance: rank {r} passes {[s[0] for _, s, _ in m]} rows, "
                f"the plan expects {int(plan.rows_per_rank[r])}"
            )
    device = tensors[names[0]].device if names else torch.device("cpu")
    views = [_row_bytes(tensors[n]) for n in names]
    widths = [v.shape[1] for v in views]
    packed = (
        torch.cat(views, 1)
        if views
        else torch.zeros((int(plan.rows_per_rank[me]), 0), dtype=torch.uint8)
    )
    w = plan.world_size
    send_rows = [plan._sends(me, d) for d in range(w)]
    recv_counts = [int(plan._sends(s, me).numel()) for s in range(w)]
    send = packed.index_select(0, torch.cat(send_rows).to(device)) if w else packed[:0]
    if is_single(dp_group):
        rows = send
    else:
        # all_to_all_single takes uneven splits on gloo too (the list form wants equal sizes).
        rows = torch.empty((sum(recv_counts), packed.shape[1]), dtype=torch.uint8, device=device)
        dist.all_to_all_single(
            rows,
            send,
            output_split_sizes=recv_counts,
            input_split_sizes=[int(r.numel()) for r in send_rows],
            group=dp_group,
        )
    js, weight = plan.samples_of(me)
    out: Dict[str, torch.Tensor] = {}
    for n, piece in zip(names, torch.split(rows, widths, dim=1)):
        shape = (rows.shape[0],) + tuple(tensors[n].shape[1:])
        # A fresh buffer: a column slice may look "contiguous" (one row) with a row stride
        # of the packed width, or start at an offset that a dtype view cannot accept.
        own = torch.empty(piece.shape, dtype=torch.uint8, device=piece.device).copy_(piece)
        out[n] = own.view(tensors[n].dtype).reshape(shape)
    is_pad = weight == 0
    for n in zero_on_pad:
        out[n][is_pad.to(out[n].device)] = 0
    return RebalancedBatch(out, weight.to(device), js.to(device), is_pad.to(device))
