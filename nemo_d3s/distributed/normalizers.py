"""Global loss denominators and the per-micro-batch loss scale for Megatron's schedule and DDP.

A step's loss is sum over kept units / D, D a global count taken once per step, so the gradient does
not depend on the micro-batch, DP, TP or CP split. DP counts are summed over the DP group
(Megatron's, without CP); TP ranks hold the same tokens and are never summed. ``cp_group`` is for
masks split over CP (each rank a slice of every row): CP ranks then sum token counts and OR row
presence before counting sequences. The Megatron backend's CP ranks hold whole rows (each
computes its own positions inside the model), so it counts over DP alone and passes none.

Megatron's ``forward_step`` scales a 2-tuple loss by cp_size / num_microbatches and DDP averages
over dp x cp, so returning ``local_sum x f`` with ``f = dp_size x num_microbatches / D`` gives
``grad(sum / D)`` (``f = dp_size / D`` for a loop that sums)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from nemo_d3s.core.checks import check_count, is_number
from nemo_d3s.core.losses import AGGREGATIONS, loss_denominator
from nemo_d3s.distributed.comm import collective_device, group_size, is_single

__all__ = ["global_loss_denominator", "StepNormalizer", "step_normalizer"]

Masks = Union[torch.Tensor, Sequence[torch.Tensor]]


def _as_list(masks: Masks, name: str) -> list:
    if isinstance(masks, torch.Tensor):
        return [masks]
    masks = list(masks)
    if not all(isinstance(m, torch.Tensor) for m in masks):
        raise ValueError(
            f"{name} must be a [B, S] bool tensor or a sequence of them (one per micro-batch)"
        )
    return masks


def global_loss_denominator(
    loss_masks: Masks,
    aggregation: str,
    dp_group: Optional[dist.ProcessGroup],
    *,
    cp_group: Optional[dist.ProcessGroup] = None,
    norm_masks: Optional[Masks] = None,
) -> float:
    """The step's loss denominator D over all ranks: a float, identical everywhere; 0.0 when nothing
    is kept (skip the step).

    loss_masks: this rank's [B, S] bool mask(s) (one per micro-batch allowed); D = tokens for
    ``token_mean``, sequences with a token for ``seq_mean_*``; norm_masks are counted instead when
    given. Under CP the masks are this rank's slices. Collectives: with CP and seq_mean_* an
    all-reduce MAX of [sum B] int32 on ``cp_group``; one all-reduce SUM of one float64 on
    ``dp_group`` (and one on ``cp_group`` for token_mean), on each group's collective device."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {aggregation!r}"
        )
    masks = _as_list(loss_masks, "loss_masks")
    counted = masks if norm_masks is None else _as_list(norm_masks, "norm_masks")
    if len(counted) != len(masks):
        raise ValueError(f"norm_masks has {len(counted)} micro-batches, loss_masks {len(masks)}")
    # The counts travel on each group's own device (CPU for gloo, the current CUDA device for
    # NCCL, which takes no CPU tensors), wherever the masks live.
    cp_split = not is_single(cp_group)
    if aggregation != "token_mean" and cp_split:
        # A sequence with tokens on any CP slice counts once: OR the row presence over CP.
        for m in masks:
            loss_denominator(m, aggregation)  # validation only
        cp_device = collective_device(cp_group)
        rows = [c.any(dim=1).to(cp_device) for c in counted]
        present = (
            torch.cat(rows).to(torch.int32)
            if rows
            else torch.zeros(0, dtype=torch.int32, device=cp_device)
        )
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=cp_group)
        local = float(present.sum())
    else:
        local = 0.0
        for m, c in zip(masks, counted):
            local += loss_denominator(m, aggregation, norm_mask=None if c is m else c)
    total = float(local)
    if not is_single(dp_group):
        t = torch.tensor([total], dtype=torch.float64, device=collective_device(dp_group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=dp_group)
        total = float(t.item())
    if aggregation == "token_mean" and cp_split:
        t = torch.tensor([total], dtype=torch.float64, device=collective_device(cp_group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=cp_group)
        total = float(t.item())
    return total


@dataclass(frozen=True)
class StepNormalizer:
    """Turns micro-batch loss SUMS into contributions whose gradient after the schedule and DDP is
    that of the full-batch mean. dp_size: ranks DDP averages over, without CP; num_microbatches:
    this rank's; megatron_schedule: the schedule divides each loss by num_microbatches (False for a
    plain summing loop)."""

    denominator: float
    dp_size: int = 1
    num_microbatches: int = 1
    megatron_schedule: bool = True

    def __post_init__(self) -> None:
        d = self.denominator
        if not is_number(d) or d <= 0:
            raise ValueError(
                "denominator must be a finite number > 0 (nothing kept anywhere: skip the "
                f"step), got {d!r}"
            )
        for name in ("dp_size", "num_microbatches"):
            v = getattr(self, name)
            check_count(name, v, 1)

    @property
    def loss_scale(self) -> float:
        """f: multiply a micro-batch's loss sum by this."""
        m = self.num_microbatches if self.megatron_schedule else 1
        return self.dp_size * m / float(self.denominator)

    def scale(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum * self.loss_scale


def step_normalizer(
    loss_masks: Masks,
    aggregation: str,
    dp_group: Optional[dist.ProcessGroup],
    *,
    num_microbatches: int,
    cp_group: Optional[dist.ProcessGroup] = None,
    norm_masks: Optional[Masks] = None,
    megatron_schedule: bool = True,
) -> StepNormalizer:
    """:func:`global_loss_denominator` + :class:`StepNormalizer` (``dp_size`` from ``dp_group``);
    same collectives."""
    d = global_loss_denominator(
        loss_masks, aggregation, dp_group, cp_group=cp_group, norm_masks=norm_masks
    )
    return StepNormalizer(d, group_size(dp_group), int(num_microbatches), megatron_schedule)
