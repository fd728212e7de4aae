"""Policy-gradient losses over per-token tensors: GRPO, GSPO and GSPO-token.

All inputs are token-aligned ``[B, S]`` tensors (position t holds the quantity of token t);
``loss_mask`` [B, S] bool marks the tokens that get a gradient (after D3S token selection:
``token_keep``). Positions outside ``loss_mask`` are never read: they may hold anything,
NaN and -inf included, without affecting the loss or its gradient.

Notation (per token t of sequence i, r = pi / pi_old):

    r_it   = exp(logprobs - old_logprobs)
    clip(r) = clamp(r, 1 - eps_low, 1 + eps_high)       (asymmetric: DAPO "clip-higher")
    l(r, A) = max(-r A, -clip(r) A)                      (PPO/GRPO clipped surrogate, to minimise)
    dual clip (c > 1, only where A < 0):  l = min(l, -c A)   (Ye et al. 2020, dual-clip PPO)

Losses (``POLICY_LOSSES``)
--------------------------
``grpo``        per token: l(r_it, A_it).
``gspo``        per sequence: s_i = exp(mean over the masked tokens of i of (logprobs -
                old_logprobs)) (GSPO, arXiv 2507.18071), L_i = l(s_i, A_i). The mean runs over
                ``loss_mask`` only, so with D3S token selection the sequence ratio is taken
                over the selected tokens. Needs one advantage per sequence: ``[B]``, or
                ``[B, S]`` constant over each row's masked tokens.
``gspo_token``  GSPO-token: per token, ratio value ``sg[s_i] x pi_t / sg[pi_t]`` (= s_i), so
                the VALUE is GSPO's sequence ratio while the gradient flows only through
                token t itself, and only on masked tokens; loss l(that, A_it) per token
                (per-token advantages allowed). With one advantage per sequence its value
                and gradient equal ``gspo``'s under every aggregation.

KL to a reference (``kl_coef`` > 0, needs ``ref_logprobs``): the k3 estimator per masked
token, ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased for KL(pi || ref) under
samples from pi), times ``kl_coef``, aggregated with the same weights as the policy term.

Aggregation and normalisation
-----------------------------
Every loss is ``sum over units / denominator``; the denominator is a GLOBAL count supplied
by the caller (:func:`loss_denominator` on each micro-batch, summed over micro-batches and
data-parallel ranks, once per optimizer step). A unit's weight depends only on its own
row, so splitting a batch by rows into micro-batches (or ranks) and summing the losses
gives exactly the full-batch loss and gradient.

With per-token losses l_it, weights w_it and m_it = loss_mask:

``token_mean``           sum_it m_it l_it / D,   D = global number of masked tokens.
``seq_mean_token_mean``  sum_i (sum_t m_it l_it / n_i) / D,   D = global number of
                         sequences; n_i = tokens of row i in ``norm_mask`` if given, else in
                         ``loss_mask``. This is the choice the papers leave open: n_i from
                         ``loss_mask`` normalises by the SELECTED tokens (the gradient scale
                         does not depend on K); ``norm_mask=response_mask`` normalises by ALL
                         response tokens (unselected tokens count as zeros).
``seq_mean_token_sum``   sum_i sum_t m_it l_it / D,   D = global number of sequences.

GSPO's loss is per sequence. It is aggregated as if each masked token of sequence i
carried the value L_i (what ``gspo_token`` computes), i.e. sequence i weighs
``sum_t w_it``: ``token_mean`` weights L_i by its number of masked tokens n_i;
``seq_mean_token_mean`` gives each sequence weight 1 (``n_i / n_norm_i`` with a
``norm_mask``), which is the GSPO paper's objective; ``seq_mean_token_sum`` weights L_i by
n_i. The rule keeps ``gspo`` and ``gspo_token`` equal in value for every aggregation.

For ``token_mean`` the "selected vs all tokens" choice lives only in the denominator
(count ``norm_mask`` tokens: ``loss_denominator(..., norm_mask=response_mask)``);
``norm_mask`` is ignored by ``token_mean`` and ``seq_mean_token_sum``.

Metrics (``LossOutput.metrics``) are additive so callers can sum them over micro-batches
and ranks before :func:`finalize_metrics` turns ``*_sum`` entries into means:

    token_count, seq_count                 masked tokens / sequences with one
    pg_loss, kl_loss                       the two parts of ``loss`` (already / denominator)
    clip_frac_low_sum                      tokens with A < 0 and ratio < 1 - eps_low
    clip_frac_high_sum                     tokens with A > 0 and ratio > 1 + eps_high
    dual_clip_frac_sum                     tokens with A < 0 and ratio > c (dual clip binding)
    ratio_sum                              sum of the ratio value per token
    approx_kl_sum                          k3 of old vs new policy per token:
                                           exp(d) - d - 1, d = logprobs - old_logprobs
    ref_kl_sum                             k3 to the reference per token (when given)

All ``*_sum`` are over masked tokens (normaliser ``token_count``); for ``gspo`` the ratio
of a token is its sequence's s_i, so the fractions are token-weighted sequence fractions.

Computation is in fp32 (fp64 when ``logprobs`` is fp64). Pure torch, no collectives.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from nemo_d3s.core.loss_parts import (
    MaskedInputs,
    clipped_surrogate,
    finish,
    prepare_inputs,
)
from nemo_d3s.core.loss_config import (
    AGGREGATIONS,
    METRIC_NORMALISERS,
    LossConfig,
    LossOutput,
    finalize_metrics,
    loss_denominator,
)
from nemo_d3s.core.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "LossConfig",
    "LossOutput",
    "POLICY_LOSSES",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "policy_loss",
    "loss_denominator",
    "finalize_metrics",
    "METRIC_NORMALISERS",
]

POLICY_LOSSES: Registry = Registry(
    "policy loss",
    "fn(logprobs[B,S], old_logprobs[B,S], advantages[B] or [B,S], loss_mask[B,S] bool, *, "
    "cfg: LossConfig, denominator: float, ref_logprobs=None, norm_mask=None) -> LossOutput",
    # per_sequence_advantage: the loss takes one advantage per sequence ([B], or [B, S]
    # constant on each row's masked tokens), so per-token reweighting must be per row.
    per_sequence_advantage=False,
)

# ---------------------------------------------------------------------------- losses


@POLICY_LOSSES.register("grpo")
def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cfg: LossConfig,
    denominator: float,
    ref_logprobs: Optional[torch.Tensor] = None,
    norm_mask: Optional[torch.Tensor] = None,
) -> LossOutput:
    """GRPO token-level clipped surrogate (optionally dual-clipped) + k3 KL.

    logprobs [B, S] (with grad), old_logprobs [B, S], advantages [B] or [B, S], loss_mask
    [B, S] bool, ref_logprobs [B, S] or None, norm_mask [B, S] bool or None
    -> LossOutput(loss = sum_it w_it l(r_it, A_it) / denominator (+ KL)).
    """
    x = prepare_inputs(
        logprobs, old_logprobs, advantages, loss_mask, cfg, denominator, ref_logprobs, norm_mask
    )
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    per_token = clipped_surrogate(ratio, x.advantages, cfg)
    pg_sum = (x.weights * per_token).sum()
    return finish(x, cfg, pg_sum, ratio, x.advantages)


def _sequence_log_ratio(x: MaskedInputs) -> torch.Tensor:
    """[B]: mean over each row's masked tokens of (logprobs - old_logprobs); 0 for a row
    without masked tokens (its weight is 0 anyway)."""
    n = x.mask.sum(dim=1).clamp(min=1).to(x.logprobs.dtype)
    return (x.logprobs - x.old_logprobs).sum(dim=1) / n


def _sequence_advantages(x: MaskedInputs, advantages: torch.Tensor) -> torch.Tensor:
    """[B] advantage per sequence: the [B] input, or a [B, S] input that must be constant on
    each row's masked tokens (GSPO's sequence loss has one advantage per sequence)."""
    has = x.mask.any(dim=1)
    if advantages.dim() == 2:
        if x.mask.shape[1] == 0:
            return x.advantages.sum(dim=1)  # no positions: zeros [B]
        inf = torch.full((), math.inf, dtype=x.advantages.dtype, device=x.advantages.device)
        hi = torch.where(x.mask, x.advantages, -inf).amax(dim=1)
        lo = torch.where(x.mask, x.advantages, inf).amin(dim=1)
        varying = has & (hi != lo)
        if bool(varying.any()):
            row = int(varying.nonzero()[0, 0])
            raise ValueError(
                "advantages [B, S] must be constant on each row's loss_mask tokens for "
                f"'gspo' (one advantage per sequence); row {row} ranges over "
                f"[{lo[row].item()}, {hi[row].item()}]. Use 'gspo_token' for per-token "
                "advantages"
            )
        seq_adv = hi
    else:
        seq_adv = advantages.to(x.advantages.dtype)
    return torch.where(
        has, seq_adv, torch.zeros((), dtype=x.advantages.dtype, device=x.advantages.device)
    )


@POLICY_LOSSES.register("gspo", per_sequence_advantage=True)
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cfg: LossConfig,
    denominator: float,
    ref_logprobs: Optional[torch.Tensor] = None,
    norm_mask: Optional[torch.Tensor] = None,
) -> LossOutput:
    """GSPO: sequence ratio s_i = exp(mean_{t in loss_mask} (logp - old_logp)), clipped per
    sequence; L_i = l(s_i, A_i) weighted by sum_t w_it (see module docstring) + k3 KL.

    Shapes as :func:`grpo_loss`; advantages [B], or [B, S] constant on each row's mask.
    """
    x = prepare_inputs(
        logprobs, old_logprobs, advantages, loss_mask, cfg, denominator, ref_logprobs, norm_mask
    )
    seq_adv = _sequence_advantages(x, advantages)  # [B]
    seq_ratio = torch.exp(_sequence_log_ratio(x))  # [B]
    seq_loss = clipped_surrogate(seq_ratio, seq_adv, cfg)  # [B]
    pg_sum = (x.weights.sum(dim=1) * seq_loss).sum()
    B, S = x.mask.shape
    return finish(
        x, cfg, pg_sum, seq_ratio.unsqueeze(1).expand(B, S), seq_adv.unsqueeze(1).expand(B, S)
    )


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cfg: LossConfig,
    denominator: float,
    ref_logprobs: Optional[torch.Tensor] = None,
    norm_mask: Optional[torch.Tensor] = None,
) -> LossOutput:
    """GSPO-token: per-token ratio sg[s_i] x pi_t / sg[pi_t] (value s_i, gradient only through
    token t, only on masked tokens), per-token advantages allowed; l(., A_it) per token.

    Shapes as :func:`grpo_loss`.
    """
    x = prepare_inputs(
        logprobs, old_logprobs, advantages, loss_mask, cfg, denominator, ref_logprobs, norm_mask
    )
    seq_ratio = torch.exp(_sequence_log_ratio(x)).detach()  # [B]
    ratio = seq_ratio.unsqueeze(1) * torch.exp(x.logprobs - x.logprobs.detach())
    per_token = clipped_surrogate(ratio, x.advantages, cfg)
    pg_sum = (x.weights * per_token).sum()
    return finish(x, cfg, pg_sum, ratio, x.advantages)


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cfg: Optional[LossConfig] = None,
    denominator: Optional[float] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    norm_mask: Optional[torch.Tensor] = None,
) -> LossOutput:
    """``POLICY_LOSSES.get(name)(...)``. Defaults: ``cfg=LossConfig()``; ``denominator`` =
    this batch's own :func:`loss_denominator` (right for a single full batch only; pass
    the global count when the batch is split)."""
    cfg = LossConfig() if cfg is None else cfg
    fn = POLICY_LOSSES.get(name)
    if denominator is None:
        if not isinstance(cfg, LossConfig):
            raise ValueError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
        denominator = loss_denominator(loss_mask, cfg.aggregation)
    return fn(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        cfg=cfg,
        denominator=denominator,
        ref_logprobs=ref_logprobs,
        norm_mask=norm_mask,
    )
