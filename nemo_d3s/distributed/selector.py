"""The DP-global D3S selector: ``core.d3s.D3SSelector`` with both selections spanning ranks.

The trainer uses this one class with one process or many (with ``dp_group=None`` every
collective is the identity and the result is the core selector's).

- ``select_samples``: every rank all-gathers the (reward, group) pairs of the data-parallel
  batch (:func:`gather_batch_groups`) and runs the CORE selector on the whole batch, then
  keeps its own rows. There is one body of selection code, so a run on any number of ranks
  takes exactly the one-process selection (advantages on full groups, PODS's
  re-normalisation with its own epsilon, the "random" rule's draws), and the stage's
  metrics are those of the whole batch.
- ``top_k`` for a scope that spans the batch keeps the top K% of the whole DP batch
  (:func:`select_tokens_global`, ``global_exact`` by default; ``local`` and
  ``gather_quantile`` for comparison with ms-swift / TRL). Per-row scopes need no collective.
- token-stage metrics are summed over the DP group (one all-reduce of a few float64).

Tensors go to ``device`` (the group's collective device: CPU for gloo, CUDA for NCCL) for
the collectives and come back on the CPU. Run with the same config on every rank of
``dp_group``; every call is collective.
"""

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
    """``D3SSelector`` over the data-parallel group ``dp_group`` (None = one process).

    batch_scope: how a batch-spanning token scope is realised across ranks (a name in
    ``DISTRIBUTED_TOKEN_SCOPES``: ``global_exact`` | ``local`` | ``gather_quantile``).
    device: where collective tensors live; default: the group's collective device.
    """

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
        """rewards [B_r] f32, group_ids [B_r] long (this rank's whole groups) -> SampleStage of
        this rank's rows, with the whole batch's ``advantage_result`` and metrics.

        Collectives on ``dp_group``: one all-gather of one int64 and one of [max_r B_r, 3]
        float64. The core selection then runs on B_total rows on every rank (O(B_total log
        B_total), microseconds at RL batch sizes).
        """
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
