"""The pieces every policy loss of :mod:`nemo_d3s.core.losses` shares: checked inputs with
everything off ``loss_mask`` made inert, the clipped surrogate, the k3 KL estimator and
:func:`finish` (KL term, global denominator, additive metrics). Pure torch."""

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
    is_real,
)
from nemo_d3s.core.loss_config import LossConfig, LossOutput

__all__ = ["LossInputs", "MaskedInputs", "clipped_surrogate", "finish", "k3", "prepare_inputs"]


@dataclass(frozen=True)
class LossInputs:
    """What every policy loss is given: logprobs [B, S] (with grad), old_logprobs [B, S], advantages
    [B] or [B, S], loss_mask [B, S] bool, ``cfg``, the step's global ``denominator``, and optional
    ref_logprobs [B, S] (KL), norm_mask [B, S] bool (row normaliser) and ratio_mask [B, S] bool
    (the tokens a sequence ratio is the mean over, for a loss that asks: the whole response)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    cfg: LossConfig
    denominator: float
    ref_logprobs: Optional[torch.Tensor] = None
    norm_mask: Optional[torch.Tensor] = None
    ratio_mask: Optional[torch.Tensor] = None


@dataclass
class MaskedInputs:
    """Validated inputs in the compute dtype, neutral values off the mask (NaN/-inf padding cannot
    reach the loss or gradient)."""

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
    if not is_real(denominator) or not math.isfinite(denominator) or denominator <= 0:
        raise ValueError(
            f"denominator must be a finite number > 0 (a global count), got {denominator!r}"
        )
    return float(denominator)


def prepare_inputs(inputs: LossInputs) -> MaskedInputs:
    """Check ``inputs`` -> compute-dtype tensors made inert off the mask, and the aggregation
    weights."""
    logprobs, old_logprobs, advantages = inputs.logprobs, inputs.old_logprobs, inputs.advantages
    loss_mask, cfg, denominator = inputs.loss_mask, inputs.cfg, inputs.denominator
    ref_logprobs, norm_mask = inputs.ref_logprobs, inputs.norm_mask
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
    return MaskedInputs(
        logprobs=clean(logprobs),
        old_logprobs=clean(old_logprobs),
        advantages=clean(adv),
        mask=loss_mask,
        weights=weights,
        ref_logprobs=None if ref_logprobs is None else clean(ref_logprobs),
        denominator=denom,
    )


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Per-unit loss to minimise: max(-r A, -clip(r) A), then min(., -c A) where A < 0."""
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    if cfg.dual_clip_c is not None:
        # For A < 0 a huge ratio would give an unbounded loss; dual clip caps it at c |A|.
        loss = torch.where(adv < 0, torch.minimum(loss, -cfg.dual_clip_c * adv), loss)
    return loss


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 KL estimator exp(x) - x - 1 for x = log(q/p) under samples from p (>= 0)."""
    return torch.exp(log_ratio) - log_ratio - 1.0


def finish(
    x: MaskedInputs,
    cfg: LossConfig,
    pg_sum: torch.Tensor,
    ratio_value: torch.Tensor,
    adv: torch.Tensor,
) -> LossOutput:
    """Add the KL term, divide by the denominator, collect additive metrics; ratio_value, adv
    [B, S]: what each masked token was clipped with."""
    mask_f = x.mask.to(pg_sum.dtype)
    kl_weighted = torch.zeros((), dtype=pg_sum.dtype, device=pg_sum.device)
    ref_kl_sum = None
    if x.ref_logprobs is not None:
        k3_ref = k3(x.ref_logprobs - x.logprobs) * mask_f
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
            "approx_kl_sum": (k3(d) * mask_f).sum(),
        }
        if ref_kl_sum is not None:
            values["ref_kl_sum"] = ref_kl_sum
    # No host copy here: LossOutput.metrics makes one when (and if) it is read.
    return LossOutput(loss, metric_tensors={k: v.to(torch.float64) for k, v in values.items()})
