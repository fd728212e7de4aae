"""The slow-step warning: a step ``logging.slow_step_factor`` x slower than the median of this
process's first ``logging.slow_step_baseline`` steps while the load average exceeds the CPU
count means oversubscribed cores; the run says so once, naming ``OMP_NUM_THREADS``.
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
    """Load average (1 min), the machine's CPUs, this process's affinity CPUs, torch's threads."""

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
    """True when the last step time is >= ``factor`` x the baseline median and the load exceeds the
    CPU count; never before the baseline is complete, with ``factor`` 0, or twice.
    """
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
