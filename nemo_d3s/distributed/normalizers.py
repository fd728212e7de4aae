"""Global loss denominators and the per-micro-batch loss scale for Megatron's schedule + DDP.

The loss of one optimizer step is ``sum over all kept units / D`` with D a GLOBAL count
(kept tokens for ``token_mean``, kept sequences for ``seq_mean_*``), counted once per step
before the micro-batch loop. Then the gradient does not depend on how the batch is split
over micro-batches, DP ranks, TP or CP.

Who counts what:

- DP ranks hold different samples: their counts are summed (all-reduce over the DP group).
- TP ranks hold the SAME tokens (only the hidden/vocab dimension is split): never summed
  over TP. Megatron's DP group already excludes TP (and PP) peers, so pass
  ``parallel_state.get_data_parallel_group()`` (without context parallelism).
- CP ranks hold different slices of the same sequences: their token counts are summed over
  ``cp_group``; a sequence appears on every CP rank of its replica, so sequences are counted
  once (row presence is OR-ed over CP before counting).

Scaling for the schedule. Megatron's ``forward_step`` multiplies what the loss function
returns (the 2-tuple ``(loss, logs)`` form) by ``cp_size`` and divides it by
``num_microbatches``; backward runs per micro-batch, so gradients are summed over them; the
DDP wrapper then AVERAGES gradients over the dp x cp ranks. If every micro-batch returns
``local_sum x f`` the final gradient is ``grad(sum_all local_sum) x f / (num_microbatches
x dp_size)``, so ``f = dp_size x num_microbatches / D`` gives ``grad(sum_all / D)`` exactly
(the cp factors cancel). For a plain loop that sums micro-batch losses without dividing,
``f = dp_size / D``. Equivalently, hand the core losses ``denominator = D / f``.
"""

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
    """The loss denominator D of one optimizer step over all ranks.

    loss_masks: this rank's [B, S] bool mask(s) of the step (one tensor, or one per
    micro-batch; S may differ between them), True = the token gets a gradient;
    aggregation: ``token_mean`` (D = tokens) or ``seq_mean_*`` (D = sequences with a
    token); norm_masks: count these instead ("normalise by all response tokens"), as in
    ``core.losses.loss_denominator``. Under CP each mask is this CP rank's slice of the
    sequences (rows aligned across the CP group).

    Collectives: seq_mean_* with a CP group: one all-reduce MAX of [sum B] uint8-as-int32
    over ``cp_group``; then one all-reduce SUM of one float64 over ``dp_group`` (and, for
    token_mean with CP, one over ``cp_group``), each on its group's collective device
    (``comm.collective_device``: CUDA for NCCL, whatever device the masks are on). Returns a float,
    identical on all ranks; 0.0 when nothing is kept anywhere (skip the step).
    """
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
    """Turns per-micro-batch loss SUMS into contributions whose gradient, after the
    schedule and DDP, is the gradient of the full-batch mean.

    denominator: global D of the step; dp_size: ranks DDP averages over, not counting CP
    (Megatron: ``get_data_parallel_world_size()``); num_microbatches: THIS rank's micro-
    batches in the step; megatron_schedule: True when the schedule divides each returned
    loss by ``num_microbatches`` (Megatron's 2-tuple loss-function form); False for a
    plain loop that sums micro-batch losses.
    """

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
    """:func:`global_loss_denominator` + :class:`StepNormalizer` with ``dp_size`` taken
    from ``dp_group``. Same collectives as :func:`global_loss_denominator`."""
    d = global_loss_denominator(
        loss_masks, aggregation, dp_group, cp_group=cp_group, norm_masks=norm_masks
    )
    return StepNormalizer(d, group_size(dp_group), int(num_microbatches), megatron_schedule)
