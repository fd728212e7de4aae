"""The DP-global D3S selector: ``core.d3s.D3SSelector`` with both selections spanning ranks.

Same methods and results types as the single-process selector (the trainer swaps one for
the other), but

- ``select_samples`` pools the whole DP batch (:func:`global_select_samples`), so
  cross-group selection and PODS see every rank's groups; each rank gets its own rows;
- ``top_k`` for token scope ``batch`` keeps the top K% of the whole DP batch
  (:func:`select_tokens_global`, scope ``global_exact`` by default; ``local`` and
  ``gather_quantile`` for comparison with ms-swift / TRL). Scope ``sample`` is per row and
  needs no collective.

Run with the same config on every rank of ``dp_group``; every call is collective.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nemo_d3s.core.d3s import D3SConfig, D3SSelector, SampleStage
from nemo_d3s.distributed.sample_selection import global_select_samples
from nemo_d3s.distributed.topk import DISTRIBUTED_TOKEN_SCOPES, select_tokens_global

__all__ = ["DistributedD3SSelector"]


class DistributedD3SSelector(D3SSelector):
    """``D3SSelector`` over the data-parallel group ``dp_group``.

    batch_scope: how token scope ``batch`` is realised across ranks (a name in
    ``DISTRIBUTED_TOKEN_SCOPES``: ``global_exact`` | ``local`` | ``gather_quantile``).
    """

    def __init__(
        self, cfg: D3SConfig, dp_group: Optional[dist.ProcessGroup], *, batch_scope: str = "global_exact"
    ) -> None:
        super().__init__(cfg)
        DISTRIBUTED_TOKEN_SCOPES.get(batch_scope)  # fail at construction on a typo
        self.dp_group = dp_group
        self.batch_scope = batch_scope

    def select_samples(self, rewards: torch.Tensor, group_ids: torch.Tensor, progress: float) -> SampleStage:
        """rewards [B_r] f32, group_ids [B_r] long (this rank's whole groups) -> SampleStage
        of this rank's rows. Collectives: two all-gathers on ``dp_group``."""
        adv = self.advantages(rewards, group_ids)
        n_keep = 1.0 if self.cfg.sample_rule == "all" else self.n_keep_at(progress)
        sel = global_select_samples(
            self.cfg.sample_rule,
            rewards,
            adv.advantages,
            group_ids,
            n_keep,
            self.dp_group,
            generator=self._generator(progress),
            eps=self.cfg.eps,
            unbiased=self.cfg.unbiased,
        )
        return self._stage(sel.sample_keep, sel.advantages, adv, n_keep, progress)

    def top_k(self, scores: torch.Tensor, eligible: torch.Tensor, k_frac: float) -> torch.Tensor:
        """[B_kept, S] -> bool [B_kept, S]; scope ``batch`` spans the DP group."""
        if self.cfg.token_scope != "batch":
            return super().top_k(scores, eligible, k_frac)
        return select_tokens_global(scores, eligible, k_frac, self.dp_group, scope=self.batch_scope).token_keep
