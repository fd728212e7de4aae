"""The DP-global D3S selector: ``core.d3s.D3SSelector`` with both selections spanning the
data-parallel ranks (``dp_group=None``: the core selector's result).

``select_samples`` all-gathers the batch's (reward, group) pairs and runs the core selector on the
whole batch, so any number of ranks takes exactly the one-process selection and metrics; ``top_k``
keeps the top K% of the whole DP batch for a batch-spanning scope (``global_exact`` by default;
``local`` / ``gather_quantile`` as ms-swift / TRL); token metrics are summed over DP. Every call is
collective: same config on every rank."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nemo_d3s.core.d3s import D3SConfig, D3SSelector, SampleStage
from nemo_d3s.core.token_selection import TOKEN_SELECTORS
from nemo_d3s.distributed.comm import collective_device, exclusive_prefix, group_rank, is_single
from nemo_d3s.distributed.sample_selection import gather_batch_groups
from nemo_d3s.distributed.topk import DISTRIBUTED_TOKEN_SCOPES, select_tokens_global

__all__ = ["DistributedD3SSelector"]


class DistributedD3SSelector(D3SSelector):
    """``D3SSelector`` over ``dp_group`` (None: one process). batch_scope: a
    ``DISTRIBUTED_TOKEN_SCOPES`` name; device: where collective tensors live (default: the group's
    collective device)."""

    def __init__(
        self,
        cfg: D3SConfig,
        dp_group: Optional[dist.ProcessGroup],
        *,
        batch_scope: str = "global_exact",
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(cfg)
        DISTRIBUTED_TOKEN_SCOPES.get(batch_scope)  # fail at construction on a typo
        self.dp_group = dp_group
        self.batch_scope = batch_scope
        self.device = torch.device(device) if device is not None else collective_device(dp_group)

    @property
    def single(self) -> bool:
        return is_single(self.dp_group)

    def select_samples(
        self, rewards: torch.Tensor, group_ids: torch.Tensor, progress: float
    ) -> SampleStage:
        """rewards [B_r] f32, group_ids [B_r] long (whole groups) -> SampleStage of this rank's rows
        with the whole batch's advantages and metrics. Collectives on ``dp_group``: an all-gather of
        one int64 and one of [max_r B_r, 3] float64."""
        if self.single:
            return super().select_samples(rewards, group_ids, progress)
        self.n_keep_at(progress)  # validate progress before any collective
        dev = self.device
        all_r, _, all_g, counts = gather_batch_groups(
            rewards.to(dev), torch.zeros_like(rewards, device=dev), group_ids.to(dev), self.dp_group
        )
        whole = super().select_samples(all_r.cpu(), all_g.cpu(), progress)
        offset = int(exclusive_prefix(counts.cpu())[group_rank(self.dp_group)])
        mine = slice(offset, offset + rewards.numel())
        return whole.rows(mine)

    def top_k(self, scores: torch.Tensor, eligible: torch.Tensor, k_frac: float) -> torch.Tensor:
        """[B_kept, S] -> bool [B_kept, S] on the CPU; a batch-spanning scope spans the DP group."""
        if self.single or not self.spans_batch:
            return super().top_k(scores, eligible, k_frac)
        sel = select_tokens_global(
            scores.to(self.device),
            eligible.to(self.device),
            k_frac,
            self.dp_group,
            scope=self.batch_scope,
        )
        return sel.token_keep.cpu()

    @property
    def spans_batch(self) -> bool:
        return bool(TOKEN_SELECTORS.prop(self.cfg.token_scope, "spans_batch"))

    def reduce_sums(self, sums: torch.Tensor) -> torch.Tensor:
        if self.single:
            return sums
        buf = sums.to(self.device, copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.dp_group)
        return buf.cpu()
