"""The policy update after selection: compaction, the loss closure, mini-batches.

Compaction (why): after token selection most response tokens carry no gradient. Rows with
no kept token are dropped, and every row is cut after its last kept token (attention
beyond it is switched off and the batch is truncated to the longest remaining row), so
the backward pass processes only what can carry a gradient. ``update_tokens`` is the sum
of the attention mask over the compacted batch: the tokens the update actually runs.

Normalisation (why): the loss callback returns SUMS; the denominator D of a mini-batch is
counted once per optimizer step over ALL data-parallel ranks (each rank's share, counted
before compaction, summed with one all-reduce) and handed to ``policy.train_step``, which
applies the step normaliser (``distributed.StepNormalizer``). Micro-batch and rank
contributions then add up to the full-batch loss, so the gradient does not depend on
micro-batch size or on the number of ranks.

Load balance (why): cross-group selection can leave one rank with most of the kept rows
and another with none, and the step waits for the most loaded rank. With ``rebalance``
(on by default under data parallelism) each mini-batch's rows are redistributed over the
DP ranks by longest-first bin packing on their token counts (``distributed.rebalance``)
before the update; a rank left without a row gets a zero-weight copy. A row's loss does not
depend on the rank that computes it, so the step is the same up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from nemo_d3s.backends.base import Policy, TokenBatch
from nemo_d3s.core.loss_config import NORMALIZE_BY, LossOutput
from nemo_d3s.core.losses import POLICY_LOSSES, LossConfig, loss_denominator
from nemo_d3s.core.token_selection import kept_lengths, rows_with_kept_tokens
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.distributed.rebalance import apply_rebalance, plan_rebalance

__all__ = [
    "UpdateBatch",
    "compact",
    "make_loss_fn",
    "minibatch_denominators",
    "rebalance_rows",
    "update_policy",
]


@dataclass
class UpdateBatch:
    """What the update sees, all aligned on U compacted rows.

    batch         TokenBatch [U, S_u] (cut after the last kept token per row)
    old_logprobs  [U, S_u] f32, token-aligned; None = the policy being updated IS the
                  rollout policy (one on-policy optimizer step), so the loss uses the
                  detached current log-probs (ratio 1, same gradient) and saves a forward
    advantages    [U] f32
    token_keep    [U, S_u] bool (the loss mask)
    minibatch     [U] long: mini-batch id of each row
    ref_logprobs  [U, S_u] f32 or None (KL to the frozen reference)
    denominators  [num_mini_batches] f64: this rank's share of each mini-batch's loss
                  denominator, counted BEFORE compaction (see ``minibatch_denominators``);
                  ``compact`` fills it, and ``update_policy`` requires it
    norm_mask     [U, S_u] bool or None: the tokens seq_mean_token_mean normalises each row
                  by when that is not the kept tokens (``normalize_by=eligible``)
    is_weight     [U, S_u] f32 or None: truncated importance weights min(pi_old / pi_engine,
                  cap) of each token (``algorithm.tis_cap`` with a vLLM engine); they scale
                  the advantage, per token, or per row for a per-sequence loss (GSPO)
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
        )


def minibatch_denominators(
    token_keep: torch.Tensor,
    minibatch: torch.Tensor,
    num_mini_batches: int,
    aggregation: str,
    norm_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[num_mini_batches] f64: this rank's share of each mini-batch's loss denominator.

    token_keep, norm_mask [B_kept, S] bool, minibatch [B_kept] long, on the sample-selected
    rows before compaction, so ``norm_mask`` (e.g. the response mask) still counts the rows
    and tail tokens that compaction drops. The caller all-reduces the shares over DP.
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
) -> UpdateBatch:
    """Inputs aligned on the B_kept sample-selected rows ([B_kept, S] / [B_kept]) -> U <= B_kept
    rows that hold at least one kept token, each cut after its last kept token.

    ``normalize_by="eligible"`` counts the denominators on every response token of the
    B_kept rows; with ``seq_mean_token_mean`` each row's own normaliser is its response
    length too, so rows are then not cut (their tail is part of the normaliser) and
    ``norm_mask`` carries the response mask.
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
    rows = rows_with_kept_tokens(token_keep)
    keep = token_keep[rows]
    sub = batch.select(rows)
    # [U] = 1 + index of the last kept token (or of the last response token for row_norm)
    lengths = kept_lengths(sub.response_mask if row_norm else keep)
    width = int(lengths.max()) if rows.numel() else 0
    within = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # [U, width]
    sub = sub.truncate(width)
    cut = TokenBatch(sub.input_ids, sub.attention_mask & within, sub.response_mask & within)
    return UpdateBatch(
        batch=cut,
        old_logprobs=None if old_logprobs is None else old_logprobs[rows, :width],
        advantages=advantages[rows],
        token_keep=keep[:, :width],
        minibatch=minibatch[rows],
        denominators=denominators,
        norm_mask=cut.response_mask if row_norm else None,
        is_weight=None if is_weight is None else is_weight[rows, :width],
    )


def make_loss_fn(loss_name: str, loss_cfg: LossConfig, upd: UpdateBatch):
    """The ``LossFn`` handed to ``policy.train_step`` for one mini-batch ``upd``.

    The policy calls it with (logprobs [b, s] with grad, idx [b] into ``upd``'s rows) and
    gets the LossOutput of the core loss with ``denominator=1``: the micro-batch's loss SUM
    and its detached metric sums (no host sync; the policy applies the step normaliser).
    """
    loss = POLICY_LOSSES.get(loss_name)
    per_sequence = bool(POLICY_LOSSES.prop(loss_name, "per_sequence_advantage"))

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
        return loss(
            logprobs,
            old,
            adv.to(dev),
            upd.token_keep[r, :s].to(dev),
            cfg=loss_cfg,
            denominator=1.0,
            ref_logprobs=ref,
            norm_mask=None if upd.norm_mask is None else upd.norm_mask[r, :s].to(dev),
        )

    return loss_fn


def _pad_width(t: Optional[torch.Tensor], width: int, value=0) -> Optional[torch.Tensor]:
    if t is None or t.shape[1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def rebalance_rows(
    upd: UpdateBatch, groups: ParallelGroups
) -> tuple[UpdateBatch, Dict[str, float]]:
    """Redistribute ``upd``'s rows (one mini-batch on this rank) over ``groups.dp`` so every
    rank runs about the same number of attended tokens. Returns this rank's new rows and
    {"dp_imbalance_before", "dp_imbalance_after"} (max/mean tokens per rank, identical on all
    ranks). A rank that would be empty while others are not gets a zero-weight copy of one
    row (its loss mask zeroed), so it contributes exactly nothing.

    Collectives on ``groups.dp``: one all-reduce (the common width), the plan's two
    all-gathers, one all-gather of the tensors' metadata and one all_to_all of the rows.
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
        "input_ids": _pad_width(upd.batch.input_ids, width),
        "attention_mask": _pad_width(upd.batch.attention_mask, width, False),
        "response_mask": _pad_width(upd.batch.response_mask, width, False),
        "token_keep": _pad_width(upd.token_keep, width, False),
        "advantages": upd.advantages.to(torch.float32),
        "minibatch": upd.minibatch,
    }
    for name in ("old_logprobs", "ref_logprobs", "norm_mask", "is_weight"):
        t = getattr(upd, name)
        if t is not None:
            tensors[name] = _pad_width(t, width, False if t.dtype == torch.bool else 0)
    moved = apply_rebalance(
        plan, {k: v.to(dev) for k, v in tensors.items()}, groups.dp, zero_on_pad=["token_keep"]
    )
    t = {k: v.cpu() for k, v in moved.tensors.items()}
    out = UpdateBatch(
        batch=TokenBatch(t["input_ids"], t["attention_mask"], t["response_mask"]),
        old_logprobs=t.get("old_logprobs"),
        advantages=t["advantages"].to(upd.advantages.dtype),
        token_keep=t["token_keep"],
        minibatch=t["minibatch"],
        ref_logprobs=t.get("ref_logprobs"),
        denominators=upd.denominators,
        norm_mask=t.get("norm_mask"),
        is_weight=t.get("is_weight"),
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

    Returns this rank's summed loss metrics (``loss``, ``pg_loss``, ``kl_loss`` already
    divided by their mini-batch's global denominator, so their sum over ranks is the loss
    of the step), the sum of the policy's ``grad_norm`` reports (identical on all ranks), the
    last ``lr``, ``update_tokens_local`` (loss-carrying tokens this rank ran: the papers'
    count), ``update_compute_tokens_local`` (their rows' attended tokens: the compute), the
    policy's ``fed_tokens`` / ``attended_tokens`` sums (micro-batch padding) and, with
    ``rebalance``, the mean ``dp_imbalance_before/after`` over the mini-batches.
    Collectives: one small all-reduce per mini-batch (+ rebalancing + the policy's own).
    """
    if upd.denominators is None:
        raise ValueError("UpdateBatch.denominators is missing: build the batch with compact()")
    totals: Dict[str, float] = {
        "optimizer_steps": 0.0,
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
        totals["optimizer_steps"] += 1
        totals["grad_norm"] += float(report.get("grad_norm", 0.0))
        totals["lr"] = float(report.get("lr", 0.0))
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
    steps = max(totals["optimizer_steps"], 1.0)
    for k, v in imbalance.items():
        totals[k] = v / steps
    return totals
