"""One object that applies a D3S / PODS configuration to a batch of rollouts, in two stages (entropy
is only computed for the samples that survive the first).

1. ``select_samples``: advantages on the FULL groups, then a sample rule keeps N per prompt
   (``d3s_cross``: from the pooled batch). Only ``pods`` re-normalises advantages.
2. ``select_tokens``: score the kept rows' eligible tokens by |A| x H, keep the top K.

N and K follow a :class:`DynamicSchedule` of progress p in [0, 1]. When every group's rewards are
equal (all advantages 0) both stages still run (a DP-global subclass keeps its collectives in step)
and flag ``all_degenerate``; the caller skips the update. Metrics are floats of this process's
batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from nemo_d3s.core.advantages import AdvantageResult, compute_advantages
from nemo_d3s.core.checks import check_bool, check_same_device, check_shape
from nemo_d3s.core.sample_selection import (
    SAMPLE_SELECTORS,
    kept_advantage_variance,
    select_samples,
    share_nonzero_advantage,
)
from nemo_d3s.core.token_selection import TOKEN_SELECTORS, k_frac_with_floor, token_scores

from nemo_d3s.core.presets import PRESETS, Count, D3SConfig

__all__ = ["D3SConfig", "PRESETS", "D3SSelector", "SampleStage", "TokenStage"]


@dataclass
class SampleStage:
    """Result of stage 1: sample_keep [B] bool; kept_rows [B_kept] long ascending (the row order of
    everything downstream); advantages [B] f32 (PODS-renormalised under ``pods``); n_keep = N used
    (1.0 for rule "all")."""

    sample_keep: torch.Tensor
    kept_rows: torch.Tensor
    advantages: torch.Tensor
    advantage_result: AdvantageResult
    n_keep: Count
    progress: float
    metrics: Dict[str, float]

    def rows(self, index) -> "SampleStage":
        """This stage on the rows ``index`` (a slice or [B_sub] index): a process's share of a
        whole-batch selection; ``kept_rows`` counts within the share, advantages, N and metrics stay
        the whole batch's."""
        keep = self.sample_keep[index]
        return SampleStage(
            sample_keep=keep,
            kept_rows=keep.nonzero().flatten(),
            advantages=self.advantages[index],
            advantage_result=self.advantage_result,
            n_keep=self.n_keep,
            progress=self.progress,
            metrics=self.metrics,
        )

    @property
    def kept_advantages(self) -> torch.Tensor:
        """[B_kept] f32"""
        return self.advantages[self.kept_rows]

    @property
    def all_degenerate(self) -> bool:
        """Every group had equal rewards: no sample carries gradient; the caller skips."""
        r = self.advantage_result
        return r.n_degenerate == r.n_groups

    @property
    def all_kept_zero(self) -> bool:
        """Every kept advantage of the whole batch is 0 (``pods`` keeping one rollout of a group
        re-normalises it to 0): no token carries a policy gradient; the caller skips. Read from the
        whole batch's metrics, so every rank of a DP-global selection agrees, as on
        :attr:`all_degenerate`."""
        return self.metrics["share_nonzero_adv"] == 0.0


@dataclass
class TokenStage:
    """token_keep [B_kept, S] bool in ``kept_rows`` order; k_frac = K used (1.0 for scope "all";
    raised above ``metrics["k_frac_schedule"]`` by ``min_kept_tokens``)."""

    token_keep: torch.Tensor
    k_frac: float
    metrics: Dict[str, float]


class D3SSelector:
    """Single-process selector (``nemo_d3s.distributed`` holds the DP-global variant); ``cfg``: a
    :class:`D3SConfig` or a mapping of its fields. No collectives; memory O(B x S)."""

    def __init__(self, cfg: Union[D3SConfig, Mapping]) -> None:
        if isinstance(cfg, Mapping):
            cfg = D3SConfig.from_mapping(cfg)
        if not isinstance(cfg, D3SConfig):
            raise ValueError(
                f"cfg must be a D3SConfig or a mapping of its fields, got {type(cfg).__name__}"
            )
        self.cfg = cfg

    @property
    def needs_entropy(self) -> bool:
        """The token scope scores tokens by |A| x H (registry property ``needs_entropy``)."""
        return bool(TOKEN_SELECTORS.prop(self.cfg.token_scope, "needs_entropy"))

    def n_keep_at(self, progress: float) -> Count:
        """N per prompt at ``progress`` in [0, 1]; 1.0 for a rule that keeps every rollout."""
        n_keep = self.cfg.schedule.at(progress)[0]
        return 1.0 if SAMPLE_SELECTORS.prop(self.cfg.sample_rule, "keeps_all") else n_keep

    def k_frac_at(self, progress: float) -> float:
        """K at ``progress`` (validated, in [0, 1]); 1.0 for a scope that keeps every token."""
        k = float(self.cfg.schedule.at(progress)[1])
        return k if self.needs_entropy else 1.0

    def _generator(self, progress: float) -> torch.Generator:
        # A per-progress seed keeps the "random" rule reproducible across resume.
        g = torch.Generator()
        g.manual_seed(self.cfg.seed * 1_000_003 + int(round(progress * 1e6)))
        return g

    def advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
        """rewards [B], group_ids [B] -> AdvantageResult over the FULL groups."""
        return compute_advantages(
            rewards, group_ids, self.cfg.advantage, eps=self.cfg.eps, unbiased=self.cfg.unbiased
        )

    def select_samples(
        self, rewards: torch.Tensor, group_ids: torch.Tensor, progress: float
    ) -> SampleStage:
        """rewards [B] f32, group_ids [B] long -> SampleStage (full-group advantages, then the
        rule)."""
        n_keep = self.n_keep_at(progress)  # validates progress first
        adv = self.advantages(rewards, group_ids)
        sel = select_samples(
            self.cfg.sample_rule,
            rewards,
            adv.advantages,
            group_ids,
            n_keep,
            generator=self._generator(progress),
            eps=self.cfg.renorm_eps,
            unbiased=self.cfg.unbiased,
            advantage=self.cfg.advantage,
        )
        return self._stage(rewards, sel.sample_keep, sel.advantages, adv, n_keep, progress)

    def _stage(
        self, rewards, sample_keep, advantages, adv: AdvantageResult, n_keep, progress
    ) -> SampleStage:
        kept_rows = sample_keep.nonzero().flatten()
        n = sample_keep.numel()
        n_kept = kept_rows.numel()
        r = rewards.detach().to(torch.float64)
        kept_adv = advantages.detach()[kept_rows].to(torch.float64)
        metrics = {
            "reward_mean": float(r.mean()) if n else 0.0,
            "reward_std": float(r.std()) if n > 1 else 0.0,
            "reward_max": float(r.max()) if n else 0.0,
            "kept_adv_abs_mean": float(kept_adv.abs().mean()) if n_kept else 0.0,
            "n_samples": float(n),
            "n_kept_samples": float(n_kept),
            "kept_sample_ratio": n_kept / max(n, 1),
            "n_keep": float(n_keep),
            "n_groups": float(adv.n_groups),
            "n_degenerate_groups": float(adv.n_degenerate),
            "n_informative_groups": float(adv.n_groups - adv.n_degenerate),
            "all_degenerate": float(adv.n_degenerate == adv.n_groups),
            # Var(A) over the whole batch (full-group advantages): the baseline kept_adv_var is
            # compared with (D3S keeps the subset that maximises it).
            "adv_var_all": float(
                adv.advantages.detach()
                .to(torch.float64)
                .var(correction=1 if self.cfg.unbiased else 0)
            )
            if n > 1
            else 0.0,
            "kept_adv_var": float(
                kept_advantage_variance(advantages, sample_keep, unbiased=self.cfg.unbiased)
            )
            if n_kept > 1
            else 0.0,
            "share_nonzero_adv": float(share_nonzero_advantage(advantages, sample_keep))
            if n_kept > 0
            else 0.0,
        }
        return SampleStage(sample_keep, kept_rows, advantages, adv, n_keep, progress, metrics)

    def token_scores(
        self, stage: SampleStage, entropy: torch.Tensor, eligible: torch.Tensor
    ) -> torch.Tensor:
        """[B_kept, S] f32 = |A| x H on eligible tokens, 0 elsewhere."""
        return token_scores(stage.kept_advantages, entropy, eligible)

    def select_tokens(
        self,
        stage: SampleStage,
        entropy: Optional[torch.Tensor],
        response_mask: torch.Tensor,
        progress: float,
    ) -> TokenStage:
        """entropy [B_kept, S] (old policy, token-aligned; None for scope "all"), response_mask
        [B_kept, S] bool in ``kept_rows`` order -> TokenStage. No eligible token gives an all-False
        mask (``n_kept_tokens == 0``, the caller skips), not an error."""
        if not isinstance(response_mask, torch.Tensor):
            raise ValueError(
                "response_mask must be a torch.Tensor [B_kept, S], got "
                f"{type(response_mask).__name__}"
            )
        check_bool("response_mask", response_mask)
        if response_mask.dim() != 2:
            raise ValueError(
                f"response_mask must be 2-D [B_kept, S], got shape {tuple(response_mask.shape)}"
            )
        b_kept = stage.kept_rows.numel()
        if response_mask.shape[0] != b_kept:
            raise ValueError(
                f"response_mask has {response_mask.shape[0]} rows but {b_kept} samples were kept; "
                "pass the rows of SampleStage.kept_rows"
            )
        k_frac = self.k_frac_at(progress)
        if entropy is None and self.needs_entropy:
            raise ValueError(
                f"entropy is required for token_scope={self.cfg.token_scope!r} "
                "(compute it for the kept rows with the old policy)"
            )
        if entropy is not None:
            if not isinstance(entropy, torch.Tensor) or not entropy.is_floating_point():
                got = entropy.dtype if isinstance(entropy, torch.Tensor) else type(entropy).__name__
                raise ValueError(f"entropy must be a floating-point tensor [B_kept, S], got {got}")
            check_shape("entropy", entropy, response_mask.shape, "response_mask")
            check_same_device(entropy=entropy, response_mask=response_mask)
        k_schedule = k_frac
        eligible = response_mask
        if self.cfg.zero_advantage_tokens == "drop":  # rows that carry no policy gradient
            eligible = response_mask & (stage.kept_advantages != 0).unsqueeze(1)
        if not self.needs_entropy:
            token_keep = eligible.clone()
        else:
            if self.cfg.min_kept_tokens:
                # The floor is per optimizer step: count the eligible tokens of every rank
                # (the same K on all of them), whatever pool the scope then draws from.
                n_step = int(self.reduce_sums(eligible.sum().to(torch.float64).reshape(1))[0])
                k_frac = k_frac_with_floor(k_frac, n_step, int(self.cfg.min_kept_tokens))
            scores = self.token_scores(stage, entropy, response_mask)
            token_keep = self.top_k(scores, eligible, k_frac)
        metrics = self._token_metrics(token_keep, eligible, entropy)
        metrics["k_frac_schedule"] = float(k_schedule)
        return TokenStage(token_keep, k_frac, metrics)

    def top_k(self, scores: torch.Tensor, eligible: torch.Tensor, k_frac: float) -> torch.Tensor:
        """scores, eligible [B_kept, S] -> token_keep [B_kept, S]; the DP-global selector overrides
        it. An empty pool gives an all-False mask."""
        return TOKEN_SELECTORS.get(self.cfg.token_scope)(scores, eligible, k_frac)

    def _token_metrics(self, token_keep, response_mask, entropy) -> Dict[str, float]:
        """Counts and entropy means of the token stage; the sums form one float64 vector, one
        all-reduce in the DP-global selector (:meth:`reduce_sums`)."""
        has_eligible = response_mask.any(dim=1)
        keys = [
            "n_eligible_tokens",
            "n_kept_tokens",
            "samples_without_tokens",
            "samples_without_eligible",
        ]
        parts = [
            response_mask.sum(),
            token_keep.sum(),
            (has_eligible & ~token_keep.any(dim=1)).sum(),
            (~has_eligible).sum(),
        ]
        if entropy is not None:
            # float64 sums: the mean must not depend on the entropy tensor's dtype.
            h = entropy.to(torch.float64)
            keys += ["entropy_kept_sum", "entropy_eligible_sum"]
            parts += [h[token_keep].sum(), h[response_mask].sum()]
        sums = dict(
            zip(keys, self.reduce_sums(torch.stack([p.to(torch.float64) for p in parts])).tolist())
        )
        n_eligible, n_kept = sums["n_eligible_tokens"], sums["n_kept_tokens"]
        metrics = {k: sums[k] for k in keys[:4]}
        metrics["kept_token_ratio"] = n_kept / max(n_eligible, 1.0)
        if entropy is not None:
            metrics["mean_entropy_kept"] = sums["entropy_kept_sum"] / n_kept if n_kept else 0.0
            metrics["mean_entropy_eligible"] = (
                sums["entropy_eligible_sum"] / n_eligible if n_eligible else 0.0
            )
        return metrics

    def reduce_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """[n] float64 sums of this process's batch -> the batch's sums (identity here; summed over
        the DP group in the DP-global selector)."""
        return sums

    def apply(
        self,
        rewards: torch.Tensor,
        group_ids: torch.Tensor,
        entropy: Optional[torch.Tensor],
        response_mask: torch.Tensor,
        progress: float,
    ) -> Tuple[SampleStage, TokenStage]:
        """Both stages on a batch with entropy known for every row: rewards, group_ids [B], entropy
        and response_mask [B, S] -> (SampleStage, TokenStage), as select_samples then
        select_tokens."""
        if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
            shape = (
                tuple(response_mask.shape)
                if isinstance(response_mask, torch.Tensor)
                else type(response_mask).__name__
            )
            raise ValueError(f"response_mask must be a 2-D tensor [B, S], got {shape}")
        if isinstance(rewards, torch.Tensor) and response_mask.shape[0] != rewards.numel():
            raise ValueError(
                f"response_mask has {response_mask.shape[0]} rows, expected "
                f"{rewards.numel()} (one per reward)"
            )
        if entropy is not None:
            if not isinstance(entropy, torch.Tensor):
                raise ValueError(
                    f"entropy must be a torch.Tensor [B, S], got {type(entropy).__name__}"
                )
            check_shape("entropy", entropy, response_mask.shape, "response_mask")
        stage = self.select_samples(rewards, group_ids, progress)
        rows = stage.kept_rows
        tok = self.select_tokens(
            stage, None if entropy is None else entropy[rows], response_mask[rows], progress
        )
        return stage, tok
