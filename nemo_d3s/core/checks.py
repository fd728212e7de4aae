"""Input validation shared by the core functions: each check raises ValueError naming the argument
and the offending value."""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch


# ---------------------------------------------------------------------------- plain values
# Python's bool is an int (True == 1): every "integer" or "number" check below refuses it,
# so a flag set by mistake is an error instead of a count of 1. The one home of these
# rules: the config sections, the tasks, the backends' settings and the core functions
# all call them.
def is_integer(v: Any) -> bool:
    """An integer (any ``numbers.Integral``: int, numpy's), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_count(v: Any, low: int = 0) -> bool:
    """An integer >= ``low``, not a bool."""
    return is_integer(v) and v >= low


def is_real(v: Any) -> bool:
    """A real number (int, float, numpy's), not a bool; NaN and +-inf included."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite real number, not a bool."""
    return is_real(v) and math.isfinite(v)


def check_count(name: str, v: Any, low: int = 0) -> None:
    """ValueError naming ``name`` unless ``v`` is an integer >= ``low`` (not a bool)."""
    if not is_count(v, low):
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")


def check_finite(name: str, t: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise if ``t`` (restricted to ``mask`` when given) holds NaN or +-inf."""
    vals = t if mask is None else t[mask]
    if vals.is_floating_point() and not torch.isfinite(vals).all():
        bad = vals[~torch.isfinite(vals)]
        raise ValueError(
            f"{name} must be finite; found {bad.numel()} non-finite value(s), e.g. {bad[0].item()}"
        )


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int], ref_name: str = "") -> None:
    """ValueError naming ``name`` unless ``t`` has ``shape``."""
    if tuple(t.shape) != tuple(shape):
        ref = f" (the shape of {ref_name})" if ref_name else ""
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}{ref}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """ValueError unless every tensor given (None aside) is on one device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_bool(name: str, t: torch.Tensor) -> None:
    """ValueError naming ``name`` unless ``t`` is a bool tensor."""
    if t.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = counts), got dtype {t.dtype}")


def check_mask_2d(name: str, mask: torch.Tensor) -> None:
    """ValueError naming ``name`` unless ``mask`` is a 2-D [B, S] bool tensor."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    check_bool(name, mask)
    if mask.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, S], got shape {tuple(mask.shape)}")


def check_fraction(name: str, value: float, *, allow_zero: bool = False) -> None:
    """K-style fractions live in (0, 1] (or [0, 1] with ``allow_zero``)."""
    lo_ok = value >= 0 if allow_zero else value > 0
    if not (lo_ok and value <= 1) or value != value:
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be in {interval}, got {value}")


def broadcast_per_row(
    name: str, advantages: torch.Tensor, B: int, S: int, ref_name: str
) -> torch.Tensor:
    """[B] (one value per row) or [B, S] -> [B, S] (a view for [B]); the shape error names
    ``ref_name``'s rows (``[B]``) or ``ref_name`` itself (``[B, S]``)."""
    if advantages.dim() == 1:
        check_shape(name, advantages, (B,), f"{ref_name}'s rows")
        return advantages.unsqueeze(1).expand(B, S)
    check_shape(name, advantages, (B, S), ref_name)
    return advantages
