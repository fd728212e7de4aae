"""The policy update after selection: compaction, the loss closure, mini-batches.

Compaction (why): after token selection most response tokens carry no gradient. Rows with
no kept token are dropped, and every row is cut after its last kept token (attention
beyond it is switched off and the batch is truncated to the longest remaining row), so
the backward pass processes only what can carry a gradient. ``update_tokens`` is the sum
of the attention mask over the compacted batch: the tokens the update actually runs.

Normalisation (why): each loss is a SUM divided by a denominator counted once per
optimizer step over the whole mini-batch on ALL data-parallel ranks (``loss_denominator``
+ all-reduce). Micro-batch and rank contributions then add up to the full-batch loss, so
the gradient does not depend on micro-batch size or on the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from nemo_d3s.backends.base import PolicyBackend, TokenBatch
from nemo_d3s.core.losses import POLICY_LOSSES, LossConfig, loss_denominator
from nemo_d3s.core.token_selection import kept_lengths, rows_with_kept_tokens
from nemo_d3s.trainer.dist import DPInfo

__all__ = ["UpdateBatch", "compact", "make_loss_fn", "minibatch_denominators", "update_policy"]


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
    denominators  [num_mini_batches] f32: this rank's share of each mini-batch's loss
                  denominator, counted BEFORE compaction (see ``minibatch_denominators``)
    norm_mask     [U, S_u] bool or None: the tokens seq_mean_token_mean normalises each row
                  by when that is not the kept tokens (``normalize_by=eligible``)
    """

    batch: TokenBatch
    old_logprobs: Optional[torch.Tensor]
    advantages: torch.Tensor
    token_keep: torch.Tensor
    minibatch: torch.Tensor
    ref_logprobs: Optional[torch.Tensor] = None
    denominators: Optional[torch.Tensor] = None
    norm_mask: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.batch)


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
) -> UpdateBatch:
    """Inputs aligned on the B_kept sample-selected rows ([B_kept, S] / [B_kept]) -> U <= B_kept
    rows that hold at least one kept token, each cut after its last kept token.

    ``normalize_by="eligible"`` counts the denominators on every response token of the
    B_kept rows; with ``seq_mean_token_mean`` each row's own normaliser is its response
    length too, so rows are then not cut (their tail is part of the normaliser) and
    ``norm_mask`` carries the response mask.
    """
    if normalize_by not in ("kept", "eligible"):
        raise ValueError(f"normalize_by must be 'kept' or 'eligible', got {normalize_by!r}")
    eligible = normalize_by == "eligible"
    denominators = minibatch_denominators(
        token_keep, minibatch, num_mini_batches, aggregation, norm_mask=batch.response_mask if eligible else None
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
    )


def make_loss_fn(
    loss_name: str,
    loss_cfg: LossConfig,
    upd: UpdateBatch,
    rows: torch.Tensor,
    denominator: float,
    sink: List[Dict[str, float]],
):
    """The ``LossFn`` handed to ``backend.train_step`` for one mini-batch.

    ``rows`` [M] maps the mini-batch's rows to ``upd``; the backend calls the closure with
    (logprobs [b, s] with grad, idx [b] into the mini-batch). Loss metrics (sums) go to ``sink``.
    """
    loss = POLICY_LOSSES.get(loss_name)

    def loss_fn(logprobs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        r = rows[idx.to(rows.device)]
        s = logprobs.shape[1]
        ref = None if upd.ref_logprobs is None else upd.ref_logprobs[r, :s].to(logprobs.device)
        old = logprobs.detach() if upd.old_logprobs is None else upd.old_logprobs[r, :s].to(logprobs.device)
        out = loss(
            logprobs,
            old,
            upd.advantages[r].to(logprobs.device),
            upd.token_keep[r, :s].to(logprobs.device),
            cfg=loss_cfg,
            denominator=denominator,
            ref_logprobs=ref,
            norm_mask=None if upd.norm_mask is None else upd.norm_mask[r, :s].to(logprobs.device),
        )
        sink.append({"loss": float(out.loss.detach()), **{k: float(v) for k, v in out.metrics.items()}})
        return out.loss

    return loss_fn


def _stub(like: TokenBatch, with_ref: bool) -> UpdateBatch:
    """A one-row, two-token stand-in with nothing to learn, for a rank whose share of a
    mini-batch is empty while other ranks' is not: the backend's gradient all-reduce is a
    collective, so every rank must run ``train_step``. Its loss mask is all False, so it
    adds exactly zero to the loss and the gradient."""
    b = like.select(torch.tensor([0])).truncate(min(2, like.input_ids.shape[1]))
    none = torch.zeros_like(b.response_mask)
    return UpdateBatch(
        batch=TokenBatch(b.input_ids, b.attention_mask, none),
        old_logprobs=torch.zeros(none.shape),
        advantages=torch.zeros(1),
        token_keep=none,
        minibatch=torch.zeros(1, dtype=torch.long),
        ref_logprobs=torch.zeros(none.shape) if with_ref else None,
    )


def update_policy(
    backend: PolicyBackend,
    upd: UpdateBatch,
    *,
    loss_name: str,
    loss_cfg: LossConfig,
    num_mini_batches: int,
    micro_batch_size: int,
    dp: DPInfo,
    fallback: TokenBatch,
) -> Dict[str, float]:
    """One optimizer step per non-empty mini-batch (globally). Returns this rank's summed
    loss metrics, the sum of the backend's ``grad_norm`` reports (identical on all ranks),
    the last ``lr``, ``update_tokens_local`` (attention sum of this rank's compacted rows)
    and ``dp_stub_rows`` (stand-in rows run to keep the gradient collective in step).

    ``fallback`` is any real batch row source for the empty-rank stand-in.
    Collectives: 2 small all-reduces per mini-batch (+ the backend's gradient reduction).
    """
    totals: Dict[str, float] = {"optimizer_steps": 0.0, "grad_norm": 0.0, "lr": 0.0}
    sink: List[Dict[str, float]] = []
    tokens, stubs = 0.0, 0
    shares = upd.denominators
    if shares is None:  # built by hand, not by compact(): count on the rows as they are
        shares = minibatch_denominators(upd.token_keep, upd.minibatch, num_mini_batches, loss_cfg.aggregation)
    for mb in range(num_mini_batches):
        rows = (upd.minibatch == mb).nonzero().flatten()
        local = {"denominator": float(shares[mb]), "rows": float(rows.numel())}
        glob = dp.sum(local)
        if glob["rows"] == 0 or glob["denominator"] == 0:
            continue  # nothing kept in this mini-batch on any rank: no optimizer step
        if rows.numel():
            sub = upd.batch.select(rows)
            sub = sub.truncate(int(sub.attention_mask.any(0).nonzero().max()) + 1)
            loss_fn = make_loss_fn(loss_name, loss_cfg, upd, rows, glob["denominator"], sink)
            tokens += float(sub.attention_mask.sum())
        else:
            stub = _stub(fallback, with_ref=upd.ref_logprobs is not None)
            sub = stub.batch
            # Its (all-zero) metrics go to the sink too, so every rank reports the same keys.
            loss_fn = make_loss_fn(loss_name, loss_cfg, stub, torch.tensor([0]), glob["denominator"], sink)
            stubs += 1  # not counted in update_tokens: it only keeps the collective in step
        report = backend.train_step(sub, loss_fn, micro_batch_size)
        totals["optimizer_steps"] += 1
        totals["grad_norm"] += float(report.get("grad_norm", 0.0))
        totals["lr"] = float(report.get("lr", 0.0))
    for m in sink:
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + v
    totals["update_tokens_local"] = tokens
    totals["dp_stub_rows"] = float(stubs)
    return totals
