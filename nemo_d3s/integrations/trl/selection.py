"""D3S on TRL's generation batch: the glue between TRL's batch dict and the project's selector;
imports no TRL (tested in the main environment too).

TRL 1.16's batch is process-major (process p holds global rows [p B_p, (p + 1) B_p)), a prompt's G
rollouts are consecutive global rows and may span processes, and every process holds the whole
batch's rewards. So the sample stage runs one core selection over the whole batch on every process
with TRL's groups and advantages (:class:`TRLD3SSelector`); the token stage is
``DistributedD3SSelector``'s (exact DP-global top-K)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from nemo_d3s.core.advantages import AdvantageResult
from nemo_d3s.core.d3s import D3SSelector, SampleStage
from nemo_d3s.distributed.selector import DistributedD3SSelector
from nemo_d3s.errors import ConfigError

__all__ = [
    "PER_ROW_KEYS",
    "PER_TOKEN_KEYS",
    "SCALAR_KEYS",
    "ROW_COUNTING_LOSSES",
    "TRLD3SSelector",
    "trl_group_ids",
    "neutral_unscorable",
    "kept_batch",
    "compact_rows",
    "step_shares",
]

# The keys of TRL 1.16's generation batch (``_generate_and_score_completions``' ``output``)
# the plugin knows how to cut: rows of [B] / [B, C] / [B, 1] tensors, and the one scalar.
PER_ROW_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "old_per_token_logps",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
)
# Of those, the ones indexed by completion position (trimmed with the completion columns).
PER_TOKEN_KEYS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
)
SCALAR_KEYS = ("num_items_in_batch",)
# TRL 1.16's loss types whose value counts a micro-batch's rows (grpo_trainer.py l.3153-3180:
# a mean over rows, or rows x max_completion_length): compaction keeps their rows.
ROW_COUNTING_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")


def trl_group_ids(n_total: int, num_generations: int) -> torch.Tensor:
    """[n_total] long: the group (prompt) of each global row, TRL's ``view(-1, G)``."""
    if num_generations < 1 or n_total % num_generations:
        raise ConfigError(
            f"num_generations: the generation batch holds {n_total} rollouts, not a multiple of "
            f"num_generations={num_generations}"
        )
    return torch.arange(n_total, dtype=torch.long) // int(num_generations)


class TRLD3SSelector(DistributedD3SSelector):
    """The DP-global selector over TRL's batch: the advantage values are TRL's (its
    ``scale_rewards`` and reward weights stand), the rule, N, degenerate groups and metrics the
    core's. PODS re-normalises the kept rollouts' rewards (TRL's weighted sum) with the core's
    ``advantage`` estimator instead: ``D3SGRPOTrainer`` refuses TRL settings it would not match.
    ``select_tokens`` is collective on ``dp_group``."""

    _given: Optional[torch.Tensor] = None

    def select_whole(
        self,
        rewards: torch.Tensor,
        advantages: torch.Tensor,
        num_generations: int,
        rows: slice,
        progress: float,
    ) -> Tuple[SampleStage, torch.Tensor]:
        """rewards, advantages [B_total] f32 (the same on every process), ``rows``: this process's
        slice -> (its SampleStage, the whole batch's sample_keep [B_total]). No collective."""
        if rewards.shape != advantages.shape or rewards.dim() != 1:
            raise ValueError(
                f"rewards {tuple(rewards.shape)} and advantages {tuple(advantages.shape)} must be "
                "the same [B_total]"
            )
        groups = trl_group_ids(rewards.numel(), num_generations)
        rewards, unscorable = neutral_unscorable(rewards.detach().float().cpu(), num_generations)
        self._given = advantages.detach().float().cpu()
        try:
            whole = D3SSelector.select_samples(self, rewards, groups, progress)
        finally:
            self._given = None
        # TRL's rule for an unscorable rollout, also where PODS re-normalised a kept one
        whole.advantages[unscorable] = 0.0
        return whole.rows(rows), whole.sample_keep

    def advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> AdvantageResult:
        base = super().advantages(rewards, group_ids)
        if self._given is None:
            return base
        return dataclasses.replace(base, advantages=self._given)


def neutral_unscorable(
    rewards: torch.Tensor, num_generations: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """rewards [B_total] with NaN (TRL's unscorable rollouts: every reward function returned
    None) -> (rewards with each NaN set to its group's mean over the scored rollouts, 0 for a
    group scored nowhere; the NaN mask [B_total]). TRL leaves such a rollout out of its group's
    baseline and gives it advantage 0 (grpo_trainer.py l.2756-2807); the group mean keeps it
    from widening the group's reward spread, so it neither turns an all-equal group into a
    kept one nor reads as an extreme to PODS' max-variance rule (a reward of 0 did both)."""
    unscorable = torch.isnan(rewards)
    if not bool(unscorable.any()):
        return rewards, unscorable
    grouped = rewards.view(-1, int(num_generations))
    means = torch.nan_to_num(torch.nanmean(grouped, dim=1, keepdim=True), nan=0.0)
    filled = torch.where(torch.isnan(grouped), means.expand_as(grouped), grouped)
    return filled.reshape(-1), unscorable


def _trim_width(mask: torch.Tensor) -> int:
    """Columns [0, w) hold every True of ``mask`` [B, C] (right-padded completions)."""
    cols = mask.any(dim=0).nonzero()
    return int(cols[-1]) + 1 if cols.numel() else 1


def kept_batch(
    batch: Mapping[str, object],
    kept_rows: torch.Tensor,
    token_keep: torch.Tensor,
    *,
    min_rows: int,
    trim_columns: bool,
    rows_over_processes: int = 0,
) -> Tuple[Dict[str, object], int]:
    """TRL's generation batch cut to the kept rollouts, with D3S's token mask: kept_rows [B_kept]
    ascending, token_keep [B_kept, C] -> (new batch, placeholder rows).

    Rows are padded with copies of row 0 whose loss mask is zero to the first multiple of
    ``min_rows`` that holds ``max(B_kept, rows_over_processes)`` (the most rows any process
    kept): every process then runs as many micro-batches, each of as many rows, which TRL's
    per-row metric gathers need (grpo_trainer.py l.3280-3282: equal shapes on every process).
    The token selection multiplies ``tool_mask``
    (TRL's loss-only mask); ``num_items_in_batch`` is the caller's (a collective). ``trim_columns``
    drops completion columns after the last kept token (causal attention). A key outside
    ``PER_ROW_KEYS`` / ``SCALAR_KEYS`` (multimodal inputs) -> ConfigError."""
    unknown = sorted(k for k in batch if k not in PER_ROW_KEYS + SCALAR_KEYS)
    if unknown:
        raise ConfigError(
            f"d3s: TRL's batch holds {unknown}, which the D3S plugin cannot cut to the kept "
            "rollouts (multimodal inputs); use d3s='grpo' or a text-only model"
        )
    n_kept = int(kept_rows.numel())
    if token_keep.shape[0] != n_kept:
        raise ValueError(f"token_keep has {token_keep.shape[0]} rows, {n_kept} rollouts were kept")
    most = max(n_kept, int(rows_over_processes))
    n_rows = max(min_rows, -(-most // min_rows) * min_rows)
    n_pad = n_rows - n_kept
    device = batch["completion_ids"].device
    rows = torch.cat([kept_rows, kept_rows.new_zeros(n_pad)]).to(device)
    loss_rows = torch.cat([token_keep, token_keep.new_zeros((n_pad, token_keep.shape[1]))])
    out: Dict[str, object] = {}
    for key, value in batch.items():
        if key in SCALAR_KEYS or value is None:
            out[key] = value
        else:
            out[key] = value[rows]
    old_tool = out.get("tool_mask")
    tool = loss_rows.to(device=device, dtype=batch["completion_mask"].dtype)
    out["tool_mask"] = tool if old_tool is None else tool * old_tool
    if trim_columns:
        width = _trim_width(out["completion_mask"].bool())
        for key in PER_TOKEN_KEYS:
            value = out.get(key)
            if value is not None and value.dim() == 2 and value.shape[1] > 1:
                out[key] = value[:, :width]
        ratio = out.get("importance_sampling_ratio")
        if ratio is not None and ratio.dim() == 2 and ratio.shape[1] > 1:
            out["importance_sampling_ratio"] = ratio[:, :width]
    return out, n_pad


def _loss_mask(batch: Mapping[str, object]) -> torch.Tensor:
    """[B, C]: the tokens TRL's loss counts (``completion_mask`` x ``tool_mask``)."""
    completion = batch["completion_mask"]
    return completion if batch.get("tool_mask") is None else completion * batch["tool_mask"]


def compact_rows(
    batch: Mapping[str, object],
    *,
    drop_rows: bool,
    ratio_columns: bool = True,
    multiple: Optional[int] = None,
    equal_rows: Optional[Callable[[int], int]] = None,
) -> Tuple[Dict[str, object], int, int]:
    """One micro-batch of a cut batch, cut after its last loss token (``completion_mask`` x
    ``tool_mask``) -> (batch, forward tokens before, after); tokens = rows x (P + C) columns.

    ``drop_rows`` drops the rows without a loss token (row 0 stays when none has one, so the
    backward runs); the completion columns after the remaining rows' last loss token go, the
    width rounded up to ``multiple``. A causal LM scores position t from positions <= t, so no
    loss token's log-prob or gradient changes. ``ratio_columns=False`` keeps a per-token
    ``importance_sampling_ratio``'s columns up to the last completion token (vespo sums its
    log over the whole row, grpo_trainer.py l.2992). ``equal_rows(kept)`` (with ``drop_rows``):
    the rows to hold, >= kept, the rest zero-loss copies of the first (with several processes,
    the most any process keeps: TRL gathers per-row metrics, which needs equal rows
    everywhere, l.3280-3282)."""
    completion = batch["completion_mask"]
    loss = _loss_mask(batch)
    n, c = loss.shape
    has_loss = loss.bool().any(dim=1)
    if not drop_rows:
        rows = None
    elif bool(has_loss.any()):
        rows = has_loss.nonzero().flatten()
    else:
        rows = torch.zeros(1, dtype=torch.long, device=loss.device)
    n_pad = 0
    if rows is not None and equal_rows is not None:
        n_pad = max(0, int(equal_rows(int(rows.numel()))) - int(rows.numel()))
    kept = loss if rows is None else loss[rows]
    width = _trim_width(kept.bool())
    ratio = batch.get("importance_sampling_ratio")
    if not ratio_columns and ratio is not None and ratio.dim() == 2 and ratio.shape[1] > 1:
        width = max(width, _trim_width((completion if rows is None else completion[rows]).bool()))
    if multiple:
        width = -(-width // multiple) * multiple
    width = min(width, c)
    out: Dict[str, object] = {}
    for key, value in batch.items():
        if key in SCALAR_KEYS or value is None:
            out[key] = value
            continue
        if rows is not None:
            value = value[rows]
        per_token = key in PER_TOKEN_KEYS or key == "importance_sampling_ratio"
        if per_token and value.dim() == 2 and value.shape[1] > 1:
            value = value[:, :width]
        out[key] = value
    if n_pad:
        out = _pad_rows(out, n_pad)
    p = int(batch["prompt_ids"].shape[1])
    return out, n * (p + c), int(out["completion_ids"].shape[0]) * (p + width)


def _pad_rows(batch: Dict[str, object], n_pad: int) -> Dict[str, object]:
    """``batch`` with ``n_pad`` copies of its row 0 appended, their ``tool_mask`` zero (no
    loss token: TRL's loss and its per-token metrics add nothing for them)."""
    n = int(batch["completion_ids"].shape[0])
    rows = torch.cat([torch.arange(n), torch.zeros(n_pad, dtype=torch.long)])
    rows = rows.to(batch["completion_ids"].device)
    out: Dict[str, object] = {
        k: v if k in SCALAR_KEYS or v is None else v[rows] for k, v in batch.items()
    }
    tool = out.get("tool_mask")
    if tool is None:
        tool = torch.ones_like(out["completion_mask"])
    tool = tool.clone()
    tool[n:] = 0
    out["tool_mask"] = tool
    return out


def step_shares(
    n_total: int, n_kept_global: int, eligible_all: float, kept_tokens: float
) -> Dict[str, float]:
    """The per-step shares: kept rollouts / rollouts, kept tokens / the whole batch's loss
    tokens."""
    return {
        "kept_sample_share": n_kept_global / max(n_total, 1),
        "kept_token_share": kept_tokens / max(eligible_all, 1.0),
        "update_tokens": float(kept_tokens),
    }
