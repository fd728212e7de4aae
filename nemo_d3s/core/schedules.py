"""Schedules of (N, K) over training progress p in [0, 1]: pure functions
``fn(progress, start, end, **kw)`` with fn(0) = start and fn(1) = end (``constant`` is always
``start``; ``step`` may jump at 0), so a resumed run gets the same (N, K). D3S (arXiv 2509.22115)
interpolates linearly."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Protocol, Sequence, Tuple, Union

from nemo_d3s.core.checks import check_fraction, is_integer, is_real
from nemo_d3s.core.registry import Registry

__all__ = ["SCHEDULES", "DynamicSchedule", "schedule_value", "linear", "cosine", "constant", "step"]

Count = Union[int, float]


class ScheduleShape(Protocol):
    """A schedule: progress p, the values at p = 0 and p = 1, the shape's keywords -> value."""

    def __call__(self, progress: float, start: float, end: float, **kw: Any) -> float: ...


SCHEDULES: Registry = Registry("schedule", ScheduleShape)


def _check_progress(progress: float) -> float:
    if (
        isinstance(progress, bool)
        or not isinstance(progress, numbers.Real)
        or not 0.0 <= float(progress) <= 1.0
    ):
        raise ValueError(f"progress must be a float in [0, 1], got {progress!r}")
    return float(progress)


def _check_endpoint(name: str, value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
    ):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _between(value: float, start: float, end: float) -> float:
    # Rounding can push an interpolant one ulp past an endpoint (e.g. 3 -> 3 at p = 0.1
    # gives 3.0000000000000004); a fraction of 1.0 would then fail its (0, 1] check.
    return min(max(value, min(start, end)), max(start, end))


def _no_kwargs(kind: str, kw: Dict[str, Any]) -> None:
    # A stray "milestones" on a linear schedule is a config mistake worth failing on.
    if kw:
        raise ValueError(
            f"kwargs {sorted(kw)!r} are not used by the {kind!r} schedule; only 'step' "
            "takes one (milestones)"
        )


@SCHEDULES.register("linear")
def linear(progress: float, start: float, end: float, **kw: Any) -> float:
    """(1 - p) * start + p * end, the D3S paper's schedule."""
    _no_kwargs("linear", kw)
    p = _check_progress(progress)
    start, end = _check_endpoint("start", start), _check_endpoint("end", end)
    return _between((1.0 - p) * start + p * end, start, end)


@SCHEDULES.register("cosine")
def cosine(progress: float, start: float, end: float, **kw: Any) -> float:
    """start + (end - start) * (1 - cos(pi p)) / 2: slow at both ends, monotone in p."""
    _no_kwargs("cosine", kw)
    p = _check_progress(progress)
    start, end = _check_endpoint("start", start), _check_endpoint("end", end)
    # start + (end - start) need not round back to end; pin the endpoint exactly.
    if p == 1.0:
        return end
    return _between(start + (end - start) * (1.0 - math.cos(math.pi * p)) / 2.0, start, end)


@SCHEDULES.register("constant")
def constant(progress: float, start: float, end: float, **kw: Any) -> float:
    """start, whatever the progress (``end`` is ignored)."""
    _no_kwargs("constant", kw)
    _check_progress(progress)
    return _check_endpoint("start", start)


@SCHEDULES.register("step")
def step(
    progress: float,
    start: float,
    end: float,
    milestones: Sequence[float] = (0.5,),
    **kw: Any,
) -> float:
    """Piecewise constant: after i of M milestones (reached at progress >= milestone) the value is
    start + (end - start) i / M. milestones: non-empty, non-decreasing, in [0, 1]."""
    _no_kwargs("step", kw)
    p = _check_progress(progress)
    start, end = _check_endpoint("start", start), _check_endpoint("end", end)
    ms = [float(x) for x in milestones]
    if not ms:
        raise ValueError(
            f"milestones must be a non-empty list of floats in [0, 1], got {list(milestones)!r}"
        )
    if any(not (0.0 <= x <= 1.0) for x in ms) or any(b < a for a, b in zip(ms, ms[1:])):
        raise ValueError(f"milestones must be non-decreasing floats in [0, 1], got {ms!r}")
    passed = sum(1 for x in ms if p >= x)
    if passed == 0:
        return start
    if passed == len(ms):
        return end  # exact, not start + (end - start) rounded
    return start + (end - start) * passed / len(ms)


def schedule_value(kind: str, progress: float, start: float, end: float, **kw: Any) -> float:
    """Evaluate the schedule ``kind`` (a name in :data:`SCHEDULES`) at ``progress``."""
    return SCHEDULES.get(kind)(progress, start, end, **kw)


@dataclass
class DynamicSchedule:
    """(N, K) as a function of progress. N is an int count (interpolation rounded half up) when
    ``n_init`` and ``n_final`` are ints, a fraction of G when both are floats; mixing them is an
    error (a config typo). K is a fraction in (0, 1]. ``kwargs`` go to the shape, for N and K."""

    kind: str = "linear"
    n_init: Count = 1.0
    n_final: Count = 1.0
    k_init: float = 1.0
    k_final: float = 1.0
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        SCHEDULES.get(self.kind)  # unknown names fail at construction, listing the known ones
        for name in ("n_init", "n_final"):
            value = getattr(self, name)
            if not is_real(value):
                raise ValueError(
                    f"{name} must be an int count >= 1 or a float fraction in (0, 1], got {value!r}"
                )
        if is_integer(self.n_init) != is_integer(self.n_final):
            raise ValueError(
                "n_init and n_final must both be int counts or both float fractions of "
                f"the group size, got n_init={self.n_init!r}, n_final={self.n_final!r}"
            )
        for name in ("n_init", "n_final"):
            value = getattr(self, name)
            if is_integer(value):
                if value < 1:
                    raise ValueError(
                        f"{name} must be >= 1 when given as an int count, got {value!r}"
                    )
            else:
                check_fraction(name, float(value))
        for name in ("k_init", "k_final"):
            value = getattr(self, name)
            if not is_real(value):
                raise ValueError(f"{name} must be a float in (0, 1], got {value!r}")
            check_fraction(name, float(value))
        self.kwargs = dict(self.kwargs or {})
        # Evaluate once so that bad kwargs (e.g. unsorted milestones) fail at start-up.
        self.at(0.0)

    @property
    def n_is_count(self) -> bool:
        return is_integer(self.n_init)

    def at(self, progress: float) -> Tuple[Count, float]:
        """progress in [0, 1] -> (n_keep, k_frac)."""
        p = _check_progress(progress)
        n = schedule_value(self.kind, p, float(self.n_init), float(self.n_final), **self.kwargs)
        k = schedule_value(self.kind, p, float(self.k_init), float(self.k_final), **self.kwargs)
        if self.n_is_count:
            # Between two counts >= 1, so the rounded value is a count >= 1 too.
            n_keep: Count = int(math.floor(n + 0.5))
        else:
            n_keep = n  # stays within [n_init, n_final] (see _between), hence in (0, 1]
        return n_keep, k
