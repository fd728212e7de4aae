"""Loss configuration, the global denominator and metric reduction, shared by every
policy loss in :mod:`nemo_d3s.core.losses` (whose docstring defines the aggregations).

Pure torch, no collectives: callers sum :func:`loss_denominator` shares and metric sums
over micro-batches and ranks themselves.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import torch

from nemo_d3s.core.checks import check_mask_2d, check_shape

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


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass
class LossConfig:
    """Clip ranges, dual clip, KL weight and aggregation (see the module docstring).

    clip_eps_low, clip_eps_high >= 0: ratio clipped to [1 - eps_low, 1 + eps_high].
    dual_clip_c: None (off) or c > 1, applied to tokens/sequences with A < 0.
    kl_coef >= 0: weight of the k3 KL to the reference (needs ref_logprobs when > 0).
    aggregation: one of ``AGGREGATIONS``.
    check_inputs: run the data-dependent input checks (finite log-probs/advantages on the
        mask, ``norm_mask`` covering ``loss_mask``). Each costs a device-to-host sync, so a
        trainer that validated its step's tensors once turns them off for the micro-batch
        loop; shape, dtype and device checks always run (they need no sync).
    """

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
            if not _is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        c = self.dual_clip_c
        if c is not None and (not _is_real(c) or math.isnan(c) or c <= 1):
            raise ValueError(f"dual_clip_c must be > 1 or None, got {c!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {self.aggregation!r}"
            )


class LossOutput:
    """loss: scalar tensor (differentiable w.r.t. logprobs); metric_tensors: additive 0-d
    float64 tensors, detached, on the loss's device (see the module docstring; reduce by
    summing, then :func:`finalize_metrics`); ``metrics``: the same as floats.

    ``metrics`` copies every value to the host in ONE transfer the first time it is read;
    a training loop sums ``metric_tensors`` over its micro-batches instead and reads them
    once per optimizer step, so the micro-batch loop never waits for the device.
    """

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
    """This micro-batch's share of the loss denominator (the caller sums it over all
    micro-batches of the optimizer step and all DP ranks).

    loss_mask [B, S] bool -> float: the number of masked tokens for ``token_mean``; the
    number of rows with at least one masked token for ``seq_mean_*``. With ``norm_mask``
    [B, S] bool the same counts are taken on ``norm_mask`` instead ("normalise by all
    response tokens"). No collectives.
    """
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
    """Turn summed metrics (over micro-batches / ranks) into means.

    Each ``<name>_sum`` listed in ``METRIC_NORMALISERS`` becomes ``<name>`` = sum / count
    (0.0 when the count is 0); every other entry (counts, pg_loss, kl_loss, ...) is passed
    through. E.g. ``clip_frac_low_sum`` -> ``clip_frac_low``, ``approx_kl_sum`` -> ``approx_kl``.
    """
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
