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
from dataclasses import dataclass
from typing import Optional

import torch

from nemo_d3s.core.checks import (
    broadcast_per_row,
    check_finite,
    check_mask_2d,
    check_same_device,
    check_shape,
)
from nemo_d3s.core.loss_config import (
    AGGREGATIONS,
    METRIC_NORMALISERS,
    LossConfig,
    LossOutput,
    _is_real,
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

# ---------------------------------------------------------------------------- shared pieces


@dataclass
class _Inputs:
    """Validated inputs, in the compute dtype, with everything outside the mask replaced by
    neutral values (so NaN/-inf padding cannot leak into the loss or the gradient)."""

    logprobs: torch.Tensor  # [B, S]; 0 off-mask, gradient gated by the mask
    old_logprobs: torch.Tensor  # [B, S]; 0 off-mask
    advantages: torch.Tensor  # [B, S]; 0 off-mask
    mask: torch.Tensor  # [B, S] bool
    weights: torch.Tensor  # [B, S] aggregation weights w_it (0 off-mask)
    ref_logprobs: Optional[torch.Tensor]  # [B, S]; 0 off-mask
    denominator: float


def _check_float(name: str, t: torch.Tensor, shape) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a floating-point tensor, got {got}")
    check_shape(name, t, shape, "loss_mask")


def _check_denominator(denominator) -> float:
    if isinstance(denominator, torch.Tensor):
        if denominator.numel() != 1:
            raise ValueError(
                f"denominator must be a number, got a tensor of shape {tuple(denominator.shape)}"
            )
        denominator = denominator.item()
    if not _is_real(denominator) or not math.isfinite(denominator) or denominator <= 0:
        raise ValueError(
            f"denominator must be a finite number > 0 (a global count), got {denominator!r}"
        )
    return float(denominator)


def _prepare(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
    denominator,
    ref_logprobs: Optional[torch.Tensor],
    norm_mask: Optional[torch.Tensor],
) -> _Inputs:
    if not isinstance(cfg, LossConfig):
        raise ValueError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    cfg.validate()
    check_mask_2d("loss_mask", loss_mask)
    B, S = loss_mask.shape
    _check_float("logprobs", logprobs, (B, S))
    _check_float("old_logprobs", old_logprobs, (B, S))
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        got = (
            advantages.dtype if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        )
        raise ValueError(f"advantages must be a floating-point tensor [B] or [B, S], got {got}")
    adv = broadcast_per_row("advantages", advantages, B, S, "loss_mask")
    if ref_logprobs is not None:
        _check_float("ref_logprobs", ref_logprobs, (B, S))
    elif cfg.kl_coef > 0:
        raise ValueError(f"ref_logprobs is required when kl_coef > 0 (kl_coef={cfg.kl_coef})")
    if norm_mask is not None:
        check_mask_2d("norm_mask", norm_mask)
        check_shape("norm_mask", norm_mask, (B, S), "loss_mask")
    check_same_device(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        loss_mask=loss_mask,
        ref_logprobs=ref_logprobs,
        norm_mask=norm_mask,
    )
    denom = _check_denominator(denominator)
    if cfg.check_inputs:  # each check is a host sync: see LossConfig.check_inputs
        check_finite("logprobs (on loss_mask positions)", logprobs, loss_mask)
        check_finite("old_logprobs (on loss_mask positions)", old_logprobs, loss_mask)
        check_finite("advantages (on loss_mask positions)", adv, loss_mask)
        if ref_logprobs is not None:
            check_finite("ref_logprobs (on loss_mask positions)", ref_logprobs, loss_mask)

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    def clean(t: torch.Tensor) -> torch.Tensor:
        # torch.where routes no gradient to unselected entries, so off-mask garbage stays inert.
        return torch.where(loss_mask, t.to(dtype), zero)

    m = loss_mask.to(dtype)
    if cfg.aggregation == "seq_mean_token_mean":
        counted = loss_mask
        if norm_mask is not None:
            if cfg.check_inputs and bool((loss_mask & ~norm_mask).any()):
                raise ValueError(
                    "norm_mask must cover loss_mask: a loss token is outside norm_mask"
                )
            counted = norm_mask
        n_row = counted.sum(dim=1).clamp(min=1).to(dtype)
        weights = m / n_row.unsqueeze(1)
    else:
        weights = m
    return _Inputs(
        logprobs=clean(logprobs),
        old_logprobs=clean(old_logprobs),
        advantages=clean(adv),
        mask=loss_mask,
        weights=weights,
        ref_logprobs=None if ref_logprobs is None else clean(ref_logprobs),
        denominator=denom,
    )


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Per-unit loss to minimise: max(-r A, -clip(r) A), then min(., -c A) where A < 0."""
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    if cfg.dual_clip_c is not None:
        # For A < 0 a huge ratio would give an unbounded loss; dual clip caps it at c |A|.
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip_c * adv), loss)
    return loss


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 KL estimator exp(x) - x - 1 for x = log(q/p) under samples from p (>= 0)."""
    return torch.exp(log_ratio) - log_ratio - 1.0


def _finish(
    x: _Inputs,
    cfg: LossConfig,
    pg_sum: torch.Tensor,
    ratio_value: torch.Tensor,
    adv: torch.Tensor,
) -> LossOutput:
    """Add the KL term, divide by the denominator, and collect additive metrics.

    ratio_value, adv [B, S]: the ratio and advantage each masked token was clipped with.
    """
    mask_f = x.mask.to(pg_sum.dtype)
    kl_weighted = torch.zeros((), dtype=pg_sum.dtype, device=pg_sum.device)
    ref_kl_sum = None
    if x.ref_logprobs is not None:
        k3_ref = _k3(x.ref_logprobs - x.logprobs) * mask_f
        ref_kl_sum = k3_ref.detach().sum()
        if cfg.kl_coef > 0:
            kl_weighted = cfg.kl_coef * (x.weights * k3_ref).sum()
    loss = (pg_sum + kl_weighted) / x.denominator

    with torch.no_grad():
        r = ratio_value.detach()
        low = (adv < 0) & (r < 1.0 - cfg.clip_eps_low) & x.mask
        high = (adv > 0) & (r > 1.0 + cfg.clip_eps_high) & x.mask
        if cfg.dual_clip_c is not None:
            dual = (adv < 0) & (r > cfg.dual_clip_c) & x.mask
        else:
            dual = torch.zeros_like(x.mask)
        d = x.logprobs.detach() - x.old_logprobs
        values = {
            "pg_loss": pg_sum.detach() / x.denominator,
            "kl_loss": kl_weighted.detach() / x.denominator,
            "token_count": mask_f.sum(),
            "seq_count": x.mask.any(dim=1).sum().to(mask_f.dtype),
            "clip_frac_low_sum": low.sum().to(mask_f.dtype),
            "clip_frac_high_sum": high.sum().to(mask_f.dtype),
            "dual_clip_frac_sum": dual.sum().to(mask_f.dtype),
            "ratio_sum": (r * mask_f).sum(),
            "approx_kl_sum": (_k3(d) * mask_f).sum(),
        }
        if ref_kl_sum is not None:
            values["ref_kl_sum"] = ref_kl_sum
    # No host copy here: LossOutput.metrics makes one when (and if) it is read.
    return LossOutput(loss, metric_tensors={k: v.to(torch.float64) for k, v in values.items()})


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
    x = _prepare(
        logprobs, old_logprobs, advantages, loss_mask, cfg, denominator, ref_logprobs, norm_mask
    )
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    per_token = _clipped_surrogate(ratio, x.advantages, cfg)
    pg_sum = (x.weights * per_token).sum()
    return _finish(x, cfg, pg_sum, ratio, x.advantages)


def _sequence_log_ratio(x: _Inputs) -> torch.Tensor:
    """[B]: mean over each row's masked tokens of (logprobs - old_logprobs); 0 for a row
    without masked tokens (its weight is 0 anyway)."""
    n = x.mask.sum(dim=1).clamp(min=1).to(x.logprobs.dtype)
    return (x.logprobs - x.old_logprobs).sum(dim=1) / n


def _sequence_advantages(x: _Inputs, advantages: torch.Tensor) -> torch.Tensor:
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
    x = _prepare(
        logprobs, old_logprobs, advantages, loss_mask, cfg, denominator, ref_logprobs, norm_mask
    )
    seq_adv = _sequence_advantages(x, advantages)  # [B]
    seq_ratio = torch.exp(_sequence_log_ratio(x))  # [B]
    seq_loss = _clipped_surrogate(seq_ratio, seq_adv, cfg)  # [B]
    pg_sum = (x.weights.sum(dim=1) * seq_loss).sum()
    B, S = x.mask.shape
    return _finish(
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
    x = _prepare(
        logprobs, old_logprobs, advantages, loss_mask, cfg, denominator, ref_logprobs, norm_mask
    )
    seq_ratio = torch.exp(_sequence_log_ratio(x)).detach()  # [B]
    ratio = seq_ratio.unsqueeze(1) * torch.exp(x.logprobs - x.logprobs.detach())
    per_token = _clipped_surrogate(ratio, x.advantages, cfg)
    pg_sum = (x.weights * per_token).sum()
    return _finish(x, cfg, pg_sum, ratio, x.advantages)


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
