"""Rollout selection over the whole data-parallel batch (D3S cross-group, PODS, ...).

Each DP rank holds whole groups, so advantages are local; a cross-group rule pools all ranks, so
every rank all-gathers (reward, advantage, group) and runs the same core selection on the rank-order
concatenation, bit-identical to ``core.select_samples`` on that batch. A group is (rank, group id):
ids may repeat across ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from nemo_d3s.core.advantages import group_index
from nemo_d3s.core.checks import check_same_device, check_shape
from nemo_d3s.core.sample_selection import SampleSelection, select_samples
from nemo_d3s.distributed.comm import all_gather_varlen, exclusive_prefix, group_rank, is_single

__all__ = ["GlobalSampleSelection", "gather_batch_groups", "global_select_samples"]

Count = Union[int, float]


@dataclass
class GlobalSampleSelection:
    """This rank's part of a DP-global selection: sample_keep [B_r] bool and advantages [B_r] f32 of
    the local rows, n_kept and n_kept_global; global_sample_keep [B_total] bool (rank-major, the
    same on every rank); counts [world] (B_r); offset of this rank's first row."""

    sample_keep: torch.Tensor
    advantages: torch.Tensor
    n_kept: int
    n_kept_global: int
    global_sample_keep: torch.Tensor
    counts: torch.Tensor
    offset: int

    @property
    def kept_rows(self) -> torch.Tensor:
        """[n_kept] long, ascending local row indices."""
        return self.sample_keep.nonzero().flatten()

    def local(self) -> SampleSelection:
        return SampleSelection(
            sample_keep=self.sample_keep, advantages=self.advantages, n_kept=self.n_kept
        )


def gather_batch_groups(
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    dp_group: Optional[dist.ProcessGroup],
):
    """All ranks' rewards, advantages [B_r] and group_ids [B_r] in rank order -> (rewards,
    advantages [B_total] in their dtypes, dense group_index [B_total] by first appearance, counts
    [world]). B_r may differ (0 allowed). Collectives: an all-gather of one int64 and one of a
    [max_r B_r, 3] float64 buffer (integers < 2^53 exact)."""
    if group_ids.numel():
        local_index, _ = group_index(group_ids)
    else:  # a rank without samples still joins the collectives
        local_index = torch.zeros(0, dtype=torch.long, device=group_ids.device)
    packed = torch.stack(
        [rewards.to(torch.float64), advantages.to(torch.float64), local_index.to(torch.float64)], 1
    )
    everything, counts = all_gather_varlen(packed, dp_group)
    index = everything[:, 2].to(torch.long)
    # Make (rank, local group) unique: offset each rank's dense numbering by the number of
    # groups on earlier ranks. A rank's group count is 1 + its largest dense index.
    rank_of_row = torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts
    )
    groups_per_rank = torch.zeros(counts.numel(), dtype=torch.long, device=counts.device)
    if index.numel():
        groups_per_rank.scatter_reduce_(0, rank_of_row, index + 1, reduce="amax")
    index = index + exclusive_prefix(groups_per_rank)[rank_of_row]
    return everything[:, 0].to(rewards.dtype), everything[:, 1].to(advantages.dtype), index, counts


def global_select_samples(
    rule: str,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    n_keep: Count,
    dp_group: Optional[dist.ProcessGroup],
    *,
    generator: Optional[torch.Generator] = None,
    eps: Optional[float] = None,
    unbiased: bool = True,
    advantage: str = "grpo",
) -> GlobalSampleSelection:
    """Apply sample rule ``rule`` to the whole DP batch; return this rank's part.

    rewards, advantages (this rank's full groups) and group_ids [B_r]; B_r may differ, 0 included.
    ``generator`` ("random") must be seeded alike on all ranks. Collectives: those of
    :func:`gather_batch_groups`; then O(B_total log B_total) on every rank, memory
    O(world x max_r B_r). ``dp_group=None`` or one rank: the core selection."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(
            "rewards must be a 1-D tensor [B], got "
            f"{getattr(rewards, 'shape', type(rewards).__name__)}"
        )
    check_shape("advantages", advantages, rewards.shape, "rewards")
    check_shape("group_ids", group_ids, rewards.shape, "rewards")
    check_same_device(rewards=rewards, advantages=advantages, group_ids=group_ids)
    kw = dict(generator=generator, eps=eps, unbiased=unbiased, advantage=advantage)
    if is_single(dp_group):
        sel = select_samples(rule, rewards, advantages, group_ids, n_keep, **kw)
        counts = torch.tensor([rewards.numel()], dtype=torch.long)
        return GlobalSampleSelection(
            sel.sample_keep, sel.advantages, sel.n_kept, sel.n_kept, sel.sample_keep, counts, 0
        )
    all_r, all_a, all_g, counts = gather_batch_groups(rewards, advantages, group_ids, dp_group)
    if all_r.numel() == 0:
        raise ValueError(
            "the data-parallel batch is empty on every rank (B_total = 0); nothing to select from"
        )
    sel = select_samples(rule, all_r, all_a, all_g, n_keep, **kw)
    offset = int(exclusive_prefix(counts)[group_rank(dp_group)])
    mine = slice(offset, offset + rewards.numel())
    keep = sel.sample_keep[mine]
    return GlobalSampleSelection(
        sample_keep=keep,
        advantages=sel.advantages[mine],
        n_kept=int(keep.sum()),
        n_kept_global=sel.n_kept,
        global_sample_keep=sel.sample_keep,
        counts=counts,
        offset=offset,
    )
