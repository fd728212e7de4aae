"""The slow-step warning, once a run: a step ``logging.slow_step_factor`` x slower than the
median of this process's first ``logging.slow_step_baseline`` steps while the load average
exceeds the CPU count (oversubscribed cores, or rewards that took longer: the step's time is
split), or a machine overloaded from the first step (the load above the CPUs while torch's
threads fill them: every step is slow, the baseline too). It names ``OMP_NUM_THREADS`` only
when fewer threads than the run uses would help.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

__all__ = [
    "Machine",
    "SlowStepWatch",
    "overloaded",
    "read_machine",
    "should_warn",
    "suggested_threads",
]


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


def overloaded(m: Machine) -> bool:
    """Other work holds the cores while torch's threads fill every CPU this process may use."""
    return m.load_1min > m.cpu_count and m.torch_threads >= m.usable_cpus


def _advice(m: Machine) -> str:
    n = suggested_threads(m)
    if n < m.torch_threads:
        fix = (
            f"Start the run with OMP_NUM_THREADS={n} (or call torch.set_num_threads({n})), the "
            "cores the other work leaves free, or run it on a quieter machine"
        )
    else:
        fix = (
            f"This run already uses {m.torch_threads} thread(s), no more than the other work "
            "leaves free: run it on a quieter machine"
        )
    return f"{fix}; logging.slow_step_factor=0 turns this warning off"


class SlowStepWatch:
    """Fed every step's time and its parts (``observe``); returns the warning once, else None.
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
        self.parts: List[Dict[str, float]] = []
        self.warned = False
        self._rule = dict(
            baseline_steps=self.baseline_steps, factor=self.factor, already_warned=False
        )

    def observe(
        self, step: int, seconds: float, parts: Optional[Dict[str, float]] = None
    ) -> Optional[str]:
        """``parts``: the step's timings by phase (``rollout``, ``reward``, ...)."""
        self.times.append(float(seconds))
        self.parts.append(dict(parts or {}))
        if self.warned or self.factor <= 0:
            return None
        if len(self.times) <= self.baseline_steps:  # the baseline: overloaded from the start?
            m = self.read_machine()
            if not overloaded(m):
                return None
            self.warned = True
            return (
                f"step {step} took {seconds:.1f} s while this machine's 1-minute load average "
                f"{m.load_1min:.1f} is above its {m.cpu_count} CPUs and torch runs "
                f"{m.torch_threads} threads, every CPU this process may use ({m.usable_cpus}): "
                "other work competes for the cores from the start, so every step is slow "
                "(later steps are not compared with these). " + _advice(m)
            )
        # the load is read only for a step that is slow already
        if not should_warn(self.times, math.inf, 0, **self._rule):
            return None
        m = self.read_machine()
        if m.load_1min <= m.cpu_count:
            return None
        self.warned = True
        base = statistics.median(self.times[: self.baseline_steps])
        head = (
            f"step {step} took {seconds:.1f} s, {seconds / base:.1f}x the median of the first "
            f"{self.baseline_steps} steps ({base:.1f} s)"
        )
        reward = self.parts[-1].get("reward")
        if reward is not None:
            before = statistics.median(
                p.get("reward", 0.0) for p in self.parts[: self.baseline_steps]
            )
            if reward - before >= 0.5 * (seconds - base):
                return (
                    f"{head}; {reward:.1f} s of it went into rewards ({before:.1f} s in the "
                    "first steps): the reward function took longer on this step's responses "
                    "(trainer.reward_timeout_s bounds one call), not the training; "
                    "logging.slow_step_factor=0 turns this warning off"
                )
        return (
            f"{head}, while this machine's 1-minute load average {m.load_1min:.1f} is above "
            f"its {m.cpu_count} CPUs (this process may use {m.usable_cpus}; torch runs "
            f"{m.torch_threads} threads): other work competes for the cores and the threads "
            "oversubscribe them. " + _advice(m)
        )
