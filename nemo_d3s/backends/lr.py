"""The learning-rate schedule both backends use: linear warm-up, then constant, linear or
cosine decay to ``min_lr_ratio`` (a multiplier of the base LR per optimizer step, for
``torch.optim.lr_scheduler.LambdaLR``)."""

from __future__ import annotations

import math
from typing import Callable, Optional

__all__ = ["LR_SCHEDULES", "lr_multiplier"]

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(
    scheduler: str, warmup_steps: int, total_steps: Optional[int], min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """LR multiplier of optimizer step ``step`` (0-based)."""
    if scheduler not in LR_SCHEDULES:
        raise ValueError(f"scheduler must be one of {', '.join(LR_SCHEDULES)}; got {scheduler!r}")
    if scheduler != "constant" and not total_steps:
        raise ValueError(f"scheduler={scheduler!r} needs total_steps > 0, got {total_steps!r}")
    warm, total, floor = warmup_steps, total_steps or 1, min_lr_ratio

    def fn(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        shape = (
            1.0 - progress if scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        )
        return floor + (1.0 - floor) * shape

    return fn
