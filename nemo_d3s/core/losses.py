"""Policy-gradient losses over token-aligned [B, S] tensors: GRPO, GSPO and GSPO-token.

``loss_mask`` [B, S] bool marks the tokens with a gradient; positions off it are never read
(NaN/-inf there change nothing). With r = exp(logprobs - old_logprobs) and
clip(r) = clamp(r, 1 - eps_low, 1 + eps_high), a unit's loss is l(r, A) = max(-r A, -clip(r) A),
dual-clipped to min(l, -c A) where A < 0 (c > 1). ``grpo``: l(r_it, A_it) per token. ``gspo``
(arXiv 2507.18071): s_i = exp(mean over row i's masked tokens of the log-ratio), L_i = l(s_i, A_i),
one advantage per sequence. ``gspo_token`` (the paper's GSPO-token under token masks): per-token
ratio sg[s_i] x pi_t / sg[pi_t], s_i over row i's whole response (``ratio_mask``) where ``gspo``
takes it over the kept tokens, the gradient through the kept tokens only; per-token advantages
allowed; equal to ``gspo`` when every response token is kept and A is per sequence. KL
(``kl_coef`` > 0): k3,
exp(ref - logp) - (ref - logp) - 1 per masked token, weighted like the policy term.

Every loss is a sum over rows divided by a global ``denominator`` (:func:`loss_denominator`
summed over micro-batches and DP ranks), so row splits give the full-batch loss and gradient:
``token_mean`` sum m l / tokens; ``seq_mean_token_mean`` sum_i (sum_t m l / n_i) / sequences,
n_i counted on ``norm_mask`` (all response tokens) if given, else on ``loss_mask``;
``seq_mean_token_sum`` sum m l / sequences. GSPO's L_i counts once per masked token (the
paper's objective under ``seq_mean_token_mean``). Metrics are additive ``*_sum`` over masked
tokens (:func:`finalize_metrics`). fp32 (fp64 for fp64 logprobs); no collectives."""

from __future__ import annotations

import math
from typing import Optional, Protocol

import torch

from nemo_d3s.core.checks import check_finite, check_mask_2d, check_shape
from nemo_d3s.core.loss_parts import (
    LossInputs,
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
    "LossInputs",
    "POLICY_LOSSES",
    "PolicyLoss",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "policy_loss",
    "loss_denominator",
    "finalize_metrics",
    "METRIC_NORMALISERS",
]


class PolicyLoss(Protocol):
    """A policy loss: one :class:`~nemo_d3s.core.loss_parts.LossInputs` -> LossOutput."""

    def __call__(self, inputs: LossInputs) -> LossOutput: ...


POLICY_LOSSES: Registry = Registry(
    "policy loss",
    PolicyLoss,
    # per_sequence_advantage: the loss takes one advantage per sequence ([B], or [B, S]
    # constant on each row's masked tokens), so per-token reweighting must be per row.
    per_sequence_advantage=False,
    # ratio_over_response: the loss reads every response token's log-ratio (``ratio_mask``),
    # so the update keeps whole rows, not cut after their last kept token.
    ratio_over_response=False,
)

# ---------------------------------------------------------------------------- losses


@POLICY_LOSSES.register("grpo")
def grpo_loss(inputs: LossInputs) -> LossOutput:
    """GRPO token-level clipped surrogate (optionally dual-clipped) + k3 KL; [B, S] inputs,
    advantages [B] or [B, S] -> LossOutput."""
    x, cfg = prepare_inputs(inputs), inputs.cfg
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    per_token = clipped_surrogate(ratio, x.advantages, cfg)
    pg_sum = (x.weights * per_token).sum()
    return finish(x, cfg, pg_sum, ratio, x.advantages)


def _sequence_log_ratio(x: MaskedInputs) -> torch.Tensor:
    """[B]: mean log-ratio over each row's masked tokens; 0 for a row without any."""
    n = x.mask.sum(dim=1).clamp(min=1).to(x.logprobs.dtype)
    return (x.logprobs - x.old_logprobs).sum(dim=1) / n


def _sequence_advantages(x: MaskedInputs, advantages: torch.Tensor) -> torch.Tensor:
    """[B] advantage per sequence: the [B] input, or a [B, S] input constant on each row's masked
    tokens (ValueError otherwise)."""
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
def gspo_loss(inputs: LossInputs) -> LossOutput:
    """GSPO: clipped sequence ratio s_i, L_i = l(s_i, A_i) weighted by the row's masked tokens + k3
    KL; advantages [B] or [B, S] constant per row."""
    x, cfg = prepare_inputs(inputs), inputs.cfg
    seq_adv = _sequence_advantages(x, inputs.advantages)  # [B]
    seq_ratio = torch.exp(_sequence_log_ratio(x))  # [B]
    seq_loss = clipped_surrogate(seq_ratio, seq_adv, cfg)  # [B]
    pg_sum = (x.weights.sum(dim=1) * seq_loss).sum()
    B, S = x.mask.shape
    return finish(
        x, cfg, pg_sum, seq_ratio.unsqueeze(1).expand(B, S), seq_adv.unsqueeze(1).expand(B, S)
    )


def _response_log_ratio(inputs: LossInputs, x: MaskedInputs) -> torch.Tensor:
    """[B], no gradient: mean log-ratio over each row's ``ratio_mask`` tokens (the whole
    response); over the loss mask without one."""
    mask = inputs.ratio_mask
    if mask is None:
        return _sequence_log_ratio(x).detach()
    check_mask_2d("ratio_mask", mask)
    check_shape("ratio_mask", mask, tuple(x.mask.shape), "loss_mask")
    if inputs.cfg.check_inputs and bool((x.mask & ~mask).any()):
        raise ValueError("ratio_mask must cover loss_mask: a loss token is outside ratio_mask")
    with torch.no_grad():
        diff = inputs.logprobs.to(x.logprobs.dtype) - inputs.old_logprobs.to(x.logprobs.dtype)
        if inputs.cfg.check_inputs:
            check_finite("log-ratio (on ratio_mask positions)", diff, mask)
        diff = torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
        return diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1).to(diff.dtype)


@POLICY_LOSSES.register("gspo_token", ratio_over_response=True)
def gspo_token_loss(inputs: LossInputs) -> LossOutput:
    """GSPO-token: per-token ratio sg[s_i] x pi_t / sg[pi_t] (value s_i over the row's
    ``ratio_mask``, the whole response; gradient through kept token t only), per-token
    advantages allowed."""
    x, cfg = prepare_inputs(inputs), inputs.cfg
    seq_ratio = torch.exp(_response_log_ratio(inputs, x))  # [B], no gradient
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
    ratio_mask: Optional[torch.Tensor] = None,
) -> LossOutput:
    """``POLICY_LOSSES.get(name)(...)``; ``denominator`` defaults to this batch's own count, right
    only when the batch is not split."""
    cfg = LossConfig() if cfg is None else cfg
    fn = POLICY_LOSSES.get(name)
    if denominator is None:
        if not isinstance(cfg, LossConfig):
            raise ValueError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
        denominator = loss_denominator(loss_mask, cfg.aggregation)
    return fn(
        LossInputs(
            logprobs,
            old_logprobs,
            advantages,
            loss_mask,
            cfg,
            denominator,
            ref_logprobs,
            norm_mask,
            ratio_mask,
        )
    )
