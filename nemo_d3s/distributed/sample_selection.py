"""Rollout selection over the whole data-parallel batch (D3S cross-group, PODS, ...).

Each DP rank holds WHOLE groups (all G rollouts of its prompts), so group advantages are
computed locally; but the cross-group rule pools the advantages of the whole optimizer-step
batch, i.e. of all ranks. So every rank all-gathers the per-sample (reward, advantage,
group) triples, runs the same deterministic core selection on the concatenation (rank
order), and keeps its own slice. The result is bit-identical to
``core.sample_selection.select_samples`` on the concatenated batch, on every rank.

Group identity: groups never span ranks (the precondition above), so a group is identified
by (rank, group id): ids may repeat across ranks (e.g. local 0..n-1 on every rank) without
merging groups. Group numbering follows first appearance in rank order, as in the core.
"""

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
    """This rank's part of a DP-global selection.

    sample_keep [B_r] bool and advantages [B_r] f32 (as ``core.SampleSelection``, for the
    local rows); n_kept: local count; n_kept_global; global_sample_keep [B_total] bool
    (identical on every rank, rank-major order); counts [world] long: B_r of every rank;
    offset: index of this rank's first row in the global order.
    """

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
    """All ranks' (rewards, advantages, group index) concatenated in rank order.

    rewards, advantages [B_r] float, group_ids [B_r] integer (B_r may differ, 0 allowed)
    -> (rewards [B_total], advantages [B_total], group_index [B_total] long dense, numbered
    by first appearance in rank order, counts [world] long). Dtypes of rewards/advantages
    are preserved. Collectives: one all-gather of one int64 and one all-gather of a
    [max_r B_r, 3] float64 buffer (integers < 2^53 travel exactly in float64).
    """
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
) -> GlobalSampleSelection:
    """Apply sample rule ``rule`` to the whole DP batch; return this rank's part.

    rewards [B_r] float, advantages [B_r] float (computed on this rank's full groups),
    group_ids [B_r] integer; n_keep: N per prompt (as in the core). Ranks may hold
    different B_r, including 0. ``generator`` (rule "random" only) must be seeded
    identically on all ranks: it draws B_total uniforms for the pooled batch.

    Collectives on ``dp_group``: see :func:`gather_batch_groups` (two all-gathers); then
    the core selection runs redundantly on every rank over B_total samples (O(B_total log
    B_total)). Memory: O(world x max_r B_r). ``dp_group=None`` or one rank: the core
    selection on the local batch (same result type).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(
            "rewards must be a 1-D tensor [B], got "
            f"{getattr(rewards, 'shape', type(rewards).__name__)}"
        )
    check_shape("advantages", advantages, rewards.shape, "rewards")
    check_shape("group_ids", group_ids, rewards.shape, "rewards")
    check_same_device(rewards=rewards, advantages=advantages, group_ids=group_ids)
    kw = dict(generator=generator, eps=eps, unbiased=unbiased)
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
