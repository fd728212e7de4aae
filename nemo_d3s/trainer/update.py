"""The policy update after selection: compaction, the loss closure, mini-batches.

Compaction drops rows with no kept token and cuts each row after its last kept token, so the
backward pass runs only what carries a gradient. The loss callback returns sums; each
mini-batch's denominator is counted once per optimizer step over all DP ranks (before
compaction), so the gradient does not depend on micro-batch size or rank count. With
``rebalance`` each mini-batch's rows are redistributed over DP by longest-first bin packing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from nemo_d3s.backends.base import Policy, TokenBatch
from nemo_d3s.backends.wrappers import pad_columns
from nemo_d3s.core.loss_config import NORMALIZE_BY, LossOutput
from nemo_d3s.core.losses import POLICY_LOSSES, LossConfig, LossInputs, loss_denominator
from nemo_d3s.core.token_selection import kept_lengths, rows_with_kept_tokens
from nemo_d3s.core.routing import NO_EXPERT
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.distributed.rebalance import apply_rebalance, plan_rebalance

__all__ = [
    "UpdateBatch",
    "compact",
    "make_loss_fn",
    "minibatch_denominators",
    "one_minibatch_loss_fn",
    "rebalance_rows",
    "update_policy",
]


@dataclass
class UpdateBatch:
    """What the update sees, all aligned on U compacted rows.

    batch         TokenBatch [U, S_u] (cut after the last kept token per row)
    old_logprobs  [U, S_u] f32; None = on-policy (the loss uses the detached current log-probs)
    advantages    [U] f32
    token_keep    [U, S_u] bool (the loss mask)
    minibatch     [U] long: mini-batch id of each row
    ref_logprobs  [U, S_u] f32 or None (KL to the frozen reference)
    denominators  [num_mini_batches] f64: this rank's share of each denominator, counted
                  before compaction (``minibatch_denominators``); required by ``update_policy``
    norm_mask     [U, S_u] bool or None: the per-row normaliser of seq_mean_token_mean when
                  that is not the kept tokens (``normalize_by=eligible``)
    is_weight     [U, S_u] f32 or None: truncated importance weights min(pi_old / pi_engine,
                  ``algorithm.tis_cap``) scaling the advantage (per row for GSPO)
    whole_rows    rows hold their whole response, not cut after the last kept token (a loss
                  whose sequence ratio reads every response token: ``gspo_token``)
    """

    batch: TokenBatch
    old_logprobs: Optional[torch.Tensor]
    advantages: torch.Tensor
    token_keep: torch.Tensor
    minibatch: torch.Tensor
    ref_logprobs: Optional[torch.Tensor] = None
    denominators: Optional[torch.Tensor] = None
    norm_mask: Optional[torch.Tensor] = None
    is_weight: Optional[torch.Tensor] = None
    whole_rows: bool = False

    def __len__(self) -> int:
        return len(self.batch)

    def select(self, rows: torch.Tensor) -> "UpdateBatch":
        """The rows ``rows`` [m] long, cut to their longest attended row (``denominators``
        stay those of the whole batch)."""
        sub = self.batch.select(rows)
        width = int(sub.attention_mask.any(0).nonzero().max()) + 1 if rows.numel() else 0
        return UpdateBatch(
            batch=sub.truncate(width),
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs[rows, :width],
            advantages=self.advantages[rows],
            token_keep=self.token_keep[rows, :width],
            minibatch=self.minibatch[rows],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[rows, :width],
            denominators=self.denominators,
            norm_mask=None if self.norm_mask is None else self.norm_mask[rows, :width],
            is_weight=None if self.is_weight is None else self.is_weight[rows, :width],
            whole_rows=self.whole_rows,
        )


def minibatch_denominators(
    token_keep: torch.Tensor,
    minibatch: torch.Tensor,
    num_mini_batches: int,
    aggregation: str,
    norm_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[num_mini_batches] f64: this rank's share of each mini-batch's loss denominator.

    Inputs [B_kept, S] / [B_kept] are the rows before compaction, so ``norm_mask`` still counts
    the rows and tails compaction drops. The caller all-reduces the shares over DP.
    """
    out = torch.zeros(num_mini_batches, dtype=torch.float64)
    for mb in range(num_mini_batches):
        rows = (minibatch == mb).nonzero().flatten()
        if rows.numel():
            nm = None if norm_mask is None else norm_mask[rows]
            out[mb] = loss_denominator(token_keep[rows], aggregation, norm_mask=nm)
    return out


def compact(
    batch: TokenBatch,
    token_keep: torch.Tensor,
    old_logprobs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    minibatch: torch.Tensor,
    *,
    num_mini_batches: int = 1,
    aggregation: str = "token_mean",
    normalize_by: str = "kept",
    is_weight: Optional[torch.Tensor] = None,
    loss_name: str = "grpo",
) -> UpdateBatch:
    """[B_kept, S] inputs -> U <= B_kept rows holding a kept token, each cut after its last one.

    With ``normalize_by="eligible"`` and ``seq_mean_token_mean`` a row's tail is part of its
    normaliser, so rows are not cut and ``norm_mask`` carries the response mask; nor for a loss
    whose sequence ratio reads the whole response (``loss_name``'s ``ratio_over_response``).
    """
    if normalize_by not in NORMALIZE_BY:
        raise ValueError(
            f"normalize_by must be one of {', '.join(NORMALIZE_BY)}, got {normalize_by!r}"
        )
    eligible = normalize_by == "eligible"
    denominators = minibatch_denominators(
        token_keep,
        minibatch,
        num_mini_batches,
        aggregation,
        norm_mask=batch.response_mask if eligible else None,
    )
    row_norm = eligible and aggregation == "seq_mean_token_mean"
    whole = row_norm or bool(POLICY_LOSSES.prop(loss_name, "ratio_over_response"))
    rows = rows_with_kept_tokens(token_keep)
    keep = token_keep[rows]
    sub = batch.select(rows)
    # [U] = 1 + index of the last kept token (or of the last response token for whole rows)
    lengths = kept_lengths(sub.response_mask if whole else keep)
    width = int(lengths.max()) if rows.numel() else 0
    within = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [U, width]
    sub = sub.truncate(width)
    cut = TokenBatch(
        sub.input_ids, sub.attention_mask & within, sub.response_mask & within, sub.routed_experts
    )
    return UpdateBatch(
        batch=cut,
        old_logprobs=None if old_logprobs is None else old_logprobs[rows, :width],
        advantages=advantages[rows],
        token_keep=keep[:, :width],
        minibatch=minibatch[rows],
        denominators=denominators,
        norm_mask=cut.response_mask if row_norm else None,
        is_weight=None if is_weight is None else is_weight[rows, :width],
        whole_rows=whole,
    )


def make_loss_fn(loss_name: str, loss_cfg: LossConfig, upd: UpdateBatch):
    """The ``LossFn`` for one mini-batch: (logprobs [b, s] with grad, idx [b] into ``upd``'s rows)
    -> the core loss with ``denominator=1`` (loss sum and detached metric sums, no host sync).
    """
    loss = POLICY_LOSSES.get(loss_name)
    per_sequence = bool(POLICY_LOSSES.prop(loss_name, "per_sequence_advantage"))
    over_response = bool(POLICY_LOSSES.prop(loss_name, "ratio_over_response"))
    if over_response and not upd.whole_rows:
        raise ValueError(
            f"loss {loss_name!r} reads every response token's log-ratio: build the batch with "
            f"compact(..., loss_name={loss_name!r}), which keeps whole rows"
        )

    def loss_fn(logprobs: torch.Tensor, idx: torch.Tensor) -> LossOutput:
        r = idx.to(upd.advantages.device)
        s = logprobs.shape[1]
        dev = logprobs.device
        ref = None if upd.ref_logprobs is None else upd.ref_logprobs[r, :s].to(dev)
        old = logprobs.detach() if upd.old_logprobs is None else upd.old_logprobs[r, :s].to(dev)
        adv = upd.advantages[r]
        if upd.is_weight is not None:
            w, keep = upd.is_weight[r, :s], upd.token_keep[r, :s]
            if per_sequence:  # one weight per row: the mean over its kept tokens
                adv = adv * (w * keep).sum(1) / keep.sum(1).clamp(min=1)
            else:
                adv = adv.unsqueeze(1) * w
        norm = None if upd.norm_mask is None else upd.norm_mask[r, :s].to(dev)
        keep = upd.token_keep[r, :s].to(dev)
        ratio = upd.batch.response_mask[r, :s].to(dev) if over_response else None
        return loss(LossInputs(logprobs, old, adv.to(dev), keep, loss_cfg, 1.0, ref, norm, ratio))

    return loss_fn


def one_minibatch_loss_fn(
    batch: TokenBatch,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_keep: torch.Tensor,
    *,
    loss_name: str = "grpo",
    aggregation: str = "token_mean",
):
    """``make_loss_fn`` over all of ``batch`` [B, S] as one mini-batch, not compacted, no
    reference, input checks off: the loss a caller driving ``Policy.train_step`` itself hands
    it (the self-check, benchmarks); its denominator is ``loss_denominator(token_keep, ...)``.
    """
    upd = UpdateBatch(
        batch=batch,
        old_logprobs=old_logprobs,
        advantages=advantages,
        token_keep=token_keep,
        minibatch=torch.zeros(len(batch), dtype=torch.long),
        whole_rows=True,
    )
    return make_loss_fn(loss_name, LossConfig(aggregation=aggregation, check_inputs=False), upd)


def rebalance_rows(
    upd: UpdateBatch, groups: ParallelGroups
) -> tuple[UpdateBatch, Dict[str, float]]:
    """Redistribute one mini-batch's rows over ``groups.dp`` so every rank runs about the same
    attended tokens; returns this rank's rows and ``dp_imbalance_before/after`` (max/mean, same on
    all ranks). An otherwise empty rank gets a zero-weight copy of one row. Collectives on
    ``groups.dp``: one all-reduce, three all-gathers, one all_to_all.
    """
    width = int(groups.max(float(upd.batch.input_ids.shape[1])))
    dev = groups.device
    tokens = upd.batch.attention_mask.sum(1).long()
    plan = plan_rebalance(tokens.to(dev), None, groups.dp)
    stats = {
        "dp_imbalance_before": plan.imbalance_before,
        "dp_imbalance_after": plan.imbalance_after,
    }
    tensors = {
        "input_ids": pad_columns(upd.batch.input_ids, width, 0),
        "attention_mask": pad_columns(upd.batch.attention_mask, width, False),
        "response_mask": pad_columns(upd.batch.response_mask, width, False),
        "token_keep": pad_columns(upd.token_keep, width, False),
        "advantages": upd.advantages.to(torch.float32),
        "minibatch": upd.minibatch,
    }
    for name in ("old_logprobs", "ref_logprobs", "norm_mask", "is_weight"):
        t = getattr(upd, name)
        if t is not None:
            tensors[name] = pad_columns(t, width, False if t.dtype == torch.bool else 0)
    if upd.batch.routed_experts is not None:
        tensors["routed_experts"] = pad_columns(upd.batch.routed_experts, width, NO_EXPERT)
    moved = apply_rebalance(
        plan, {k: v.to(dev) for k, v in tensors.items()}, groups.dp, zero_on_pad=["token_keep"]
    )
    t = {k: v.cpu() for k, v in moved.tensors.items()}
    out = UpdateBatch(
        batch=TokenBatch(
            t["input_ids"], t["attention_mask"], t["response_mask"], t.get("routed_experts")
        ),
        old_logprobs=t.get("old_logprobs"),
        advantages=t["advantages"].to(upd.advantages.dtype),
        token_keep=t["token_keep"],
        minibatch=t["minibatch"],
        ref_logprobs=t.get("ref_logprobs"),
        denominators=upd.denominators,
        norm_mask=t.get("norm_mask"),
        is_weight=t.get("is_weight"),
        whole_rows=upd.whole_rows,
    )
    return (out.select(torch.arange(len(out))) if len(out) else out), stats


def update_policy(
    policy: Policy,
    upd: UpdateBatch,
    *,
    loss_name: str,
    loss_cfg: LossConfig,
    num_mini_batches: int,
    micro_batch_size: int,
    groups: ParallelGroups,
    rebalance: bool = False,
    micro_batch_tokens: int = 0,
) -> Dict[str, float]:
    """One optimizer step per mini-batch that holds a kept token on some rank.

    Returns ``optimizer_steps`` (applied ones) and ``skipped_nonfinite`` (mini-batches whose
    gradient norm was not finite: the backend applied nothing, the same on every rank); of the
    applied steps only: this rank's loss metrics (already divided by the global denominators,
    so they sum over ranks to the step's loss), the summed ``grad_norm``,
    ``update_tokens_local`` (loss-carrying tokens), ``update_compute_tokens_local`` (their rows'
    attended tokens), ``fed_tokens`` / ``attended_tokens``; the last ``lr`` and, with
    ``rebalance``, the mean ``dp_imbalance_before/after``. Collectives: one small all-reduce
    per mini-batch (+ the rebalancing's and the policy's own).
    """
    if upd.denominators is None:
        raise ValueError("UpdateBatch.denominators is missing: build the batch with compact()")
    totals: Dict[str, float] = {
        "optimizer_steps": 0.0,
        "skipped_nonfinite": 0.0,
        "grad_norm": 0.0,
        "lr": 0.0,
        "update_tokens_local": 0.0,
        "update_compute_tokens_local": 0.0,
    }
    imbalance: Dict[str, float] = {}
    for mb in range(num_mini_batches):
        rows = (upd.minibatch == mb).nonzero().flatten()
        denominator = groups.sum({"d": float(upd.denominators[mb])})["d"]
        if denominator == 0:
            continue  # nothing kept in this mini-batch on any rank: no optimizer step
        sub = upd.select(rows)
        if rebalance:
            sub, stats = rebalance_rows(sub, groups)
            for k, v in stats.items():
                imbalance[k] = imbalance.get(k, 0.0) + v
        report = policy.train_step(
            sub.batch,
            make_loss_fn(loss_name, loss_cfg, sub),
            micro_batch_size,
            denominator=denominator,
            micro_batch_tokens=micro_batch_tokens,
        )
        totals["lr"] = float(report.get("lr", 0.0))
        if report.get("skipped"):
            # A non-finite gradient: no weight moved, so its tokens and losses are not counted
            # as trained (update_tokens_total, tokens to a threshold).
            totals["skipped_nonfinite"] += 1
            continue
        totals["optimizer_steps"] += 1
        totals["grad_norm"] += float(report.get("grad_norm", 0.0))
        if len(sub):
            real = sub.token_keep.any(1)  # not a zero-weight pad copy
            totals["update_tokens_local"] += float(sub.token_keep.sum())
            totals["update_compute_tokens_local"] += float(sub.batch.attention_mask[real].sum())
        for k, v in report.items():
            if k not in ("grad_norm", "lr", "skipped", "n_micro_batches"):
                name = "loss" if k == "loss_sum" else k
                # loss and its two parts are divided by this mini-batch's global denominator
                scale = 1.0 / denominator if name in ("loss", "pg_loss", "kl_loss") else 1.0
                totals[name] = totals.get(name, 0.0) + v * scale
    steps = max(totals["optimizer_steps"] + totals["skipped_nonfinite"], 1.0)  # rebalanced ones
    for k, v in imbalance.items():
        totals[k] = v / steps
    return totals
