"""Loss configuration, the global denominator and metric reduction shared by the losses of
:mod:`nemo_d3s.core.losses` (whose docstring defines the aggregations). No collectives: callers sum
denominator shares and metric sums over micro-batches and ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch

from nemo_d3s.core.checks import check_mask_2d, check_shape, is_real

__all__ = [
    "AGGREGATIONS",
    "LossConfig",
    "LossOutput",
    "METRIC_NORMALISERS",
    "NORMALIZE_BY",
    "finalize_metrics",
    "loss_denominator",
]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
#: What the loss is normalised by once tokens are selected (``trainer.update``): the kept
#: tokens, or every response token of the sample-selected rows (``loss_denominator``'s
#: ``norm_mask``).
NORMALIZE_BY = ("kept", "eligible")

#: ``finalize_metrics`` maps each ``<name>_sum`` to ``<name> = sum / metrics[count]``.
METRIC_NORMALISERS: Dict[str, str] = {
    "clip_frac_low_sum": "token_count",
    "clip_frac_high_sum": "token_count",
    "dual_clip_frac_sum": "token_count",
    "ratio_sum": "token_count",
    "approx_kl_sum": "token_count",
    "ref_kl_sum": "token_count",
}


@dataclass
class LossConfig:
    """Clip ranges [1 - eps_low, 1 + eps_high], dual clip c > 1 (None: off), k3 KL weight and
    aggregation (one of ``AGGREGATIONS``).

    ``check_inputs``: run the data-dependent checks (finite inputs on the mask, ``norm_mask``
    covering ``loss_mask``); each costs a host sync, so a trainer that checked the step once turns
    them off in the micro-batch loop. Shape, dtype and device checks always run."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: Optional[float] = None
    kl_coef: float = 0.0
    aggregation: str = "token_mean"
    check_inputs: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
            v = getattr(self, name)
            if not is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        c = self.dual_clip_c
        if c is not None and (not is_real(c) or math.isnan(c) or c <= 1):
            raise ValueError(f"dual_clip_c must be > 1 or None, got {c!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {self.aggregation!r}"
            )


class LossOutput:
    """loss: differentiable scalar; metric_tensors: additive detached 0-d float64 tensors on the
    loss's device (sum them, then :func:`finalize_metrics`); ``metrics``: the same as floats, copied
    to the host in one transfer on first read, so a loop sums ``metric_tensors`` instead."""

    __slots__ = ("loss", "metric_tensors", "_floats")

    def __init__(
        self,
        loss: torch.Tensor,
        metrics: Optional[Mapping[str, float]] = None,
        *,
        metric_tensors: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        self.loss = loss
        self.metric_tensors: Dict[str, torch.Tensor] = dict(metric_tensors or {})
        self._floats: Optional[Dict[str, float]] = None
        if metrics is not None:
            self._floats = {k: float(v) for k, v in metrics.items()}
            if not self.metric_tensors:
                self.metric_tensors = {
                    k: torch.tensor(v, dtype=torch.float64) for k, v in self._floats.items()
                }

    @property
    def metrics(self) -> Dict[str, float]:
        if self._floats is None:
            keys = list(self.metric_tensors)
            values = (
                torch.stack([self.metric_tensors[k].to(torch.float64) for k in keys]).tolist()
                if keys
                else []
            )
            self._floats = dict(zip(keys, values))
        return self._floats

    def __repr__(self) -> str:
        return f"LossOutput(loss={self.loss!r}, metrics={self.metrics!r})"


def loss_denominator(
    loss_mask: torch.Tensor, aggregation: str, *, norm_mask: Optional[torch.Tensor] = None
) -> float:
    """This micro-batch's share of the loss denominator (summed by the caller over the step's
    micro-batches and DP ranks): loss_mask [B, S] -> float, masked tokens for ``token_mean``, rows
    with a masked token for ``seq_mean_*``; counted on ``norm_mask`` when given."""
    check_mask_2d("loss_mask", loss_mask)
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {aggregation!r}"
        )
    mask = loss_mask
    if norm_mask is not None:
        check_mask_2d("norm_mask", norm_mask)
        check_shape("norm_mask", norm_mask, loss_mask.shape, "loss_mask")
        mask = norm_mask
    if aggregation == "token_mean":
        return float(mask.sum())
    return float(mask.any(dim=1).sum())


def finalize_metrics(metrics: Mapping[str, float]) -> Dict[str, float]:
    """Summed metrics -> means: each ``<name>_sum`` in ``METRIC_NORMALISERS`` becomes ``<name>`` =
    sum / count (0.0 for a 0 count); other entries pass through."""
    out: Dict[str, float] = {}
    for key, value in metrics.items():
        count_key = METRIC_NORMALISERS.get(key)
        if count_key is None:
            out[key] = float(value)
            continue
        if count_key not in metrics:
            raise ValueError(f"metrics has {key!r} but not its count {count_key!r}")
        count = float(metrics[count_key])
        out[key[: -len("_sum")]] = float(value) / count if count > 0 else 0.0
    return out
