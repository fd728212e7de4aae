"""The slow-step warning: a step far slower than the run's own first steps while the machine's
load average is above its CPU count means other work competes for the cores and torch's
threads oversubscribe them (a 22 s step took 800-980 s on a shared 2-core machine). The run
says so once, with the numbers it saw and the fix (``OMP_NUM_THREADS``).

The rule is :func:`should_warn`, a pure function of the step times and the load;
:class:`SlowStepWatch` keeps the times and reads the machine (only for a step that is slow
already). The baseline is this process's first steps: a resumed run, perhaps on another
machine, measures its own. Settings: ``logging.slow_step_factor`` (0 turns it off) and
``logging.slow_step_baseline``.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

__all__ = ["Machine", "SlowStepWatch", "read_machine", "should_warn", "suggested_threads"]


@dataclass(frozen=True)
class Machine:
    """What the warning names: the 1-minute load average (machine-wide, this run's threads
    included), the machine's CPUs, the CPUs this process may run on (its affinity mask) and
    torch's intra-op threads."""

    load_1min: float
    cpu_count: int
    usable_cpus: int
    torch_threads: int


def read_machine() -> Machine:
    import torch

    cpus = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = cpus
    return Machine(os.getloadavg()[0], cpus, usable, torch.get_num_threads())


def should_warn(
    step_times: Sequence[float],
    load_1min: float,
    cpu_count: int,
    *,
    baseline_steps: int,
    factor: float,
    already_warned: bool,
) -> bool:
    """True when the last of ``step_times`` (seconds, in step order) is at least ``factor``
    x the median of the first ``baseline_steps`` and the load average is above the machine's
    CPU count; never before the baseline is complete, never when ``factor`` is 0, never
    twice (``already_warned``)."""
    if already_warned or factor <= 0 or len(step_times) <= baseline_steps:
        return False
    base = statistics.median(step_times[:baseline_steps])
    return step_times[-1] >= factor * base and load_1min > cpu_count


def suggested_threads(m: Machine) -> int:
    """The cores the other work leaves free: CPUs minus the load that is not this run's own
    threads, at most the affinity mask, at least 1."""
    others = max(0.0, m.load_1min - m.torch_threads)
    return max(1, min(m.usable_cpus, math.floor(m.cpu_count - others)))


class SlowStepWatch:
    """Fed every step's time (``observe``); returns the warning once, else None.
    ``read_machine``: injected by tests."""

    def __init__(
        self,
        *,
        factor: float,
        baseline_steps: int,
        read_machine: Callable[[], Machine] = read_machine,
    ) -> None:
        self.factor = float(factor)
        self.baseline_steps = int(baseline_steps)
        self.read_machine = read_machine
        self.times: List[float] = []
        self.warned = False

    def observe(self, step: int, seconds: float) -> Optional[str]:
        self.times.append(float(seconds))
        # the load is read only for a step that is slow already (and not after the warning)
        if not should_warn(
            self.times,
            math.inf,
            0,
            baseline_steps=self.baseline_steps,
            factor=self.factor,
            already_warned=self.warned,
        ):
            return None
        m = self.read_machine()
        if not should_warn(
            self.times,
            m.load_1min,
            m.cpu_count,
            baseline_steps=self.baseline_steps,
            factor=self.factor,
            already_warned=self.warned,
        ):
            return None
        self.warned = True
        base = statistics.median(self.times[: self.baseline_steps])
        n = suggested_threads(m)
        return (
            f"step {step} took {seconds:.1f} s, {seconds / base:.1f}x the median of the first "
            f"{self.baseline_steps} steps ({base:.1f} s), while this machine's 1-minute load "
            f"average {m.load_1min:.1f} is above its {m.cpu_count} CPUs (this process may use "
            f"{m.usable_cpus}; torch runs {m.torch_threads} threads): other work competes for "
            f"the cores and the threads oversubscribe them. Start the run with "
            f"OMP_NUM_THREADS={n} (or call torch.set_num_threads({n})), the cores the other "
            "work leaves free, or run it on a quieter machine; logging.slow_step_factor=0 "
            "turns this warning off"
        )
