"""What a task is: prompts with a verifiable answer and an exact reward, built by a factory
registered in ``TASKS`` (``factory(**options) -> Task``; ``task.name=chain_sum`` picks one)."""

from __future__ import annotations

import abc
import math
import random
from dataclasses import dataclass, field
import logging
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union

from nemo_d3s.core.registry import Registry

log = logging.getLogger("nemo_d3s.tasks")

# Why a reward call failed (reward 0, counted per step as reward_failed_<reason>): it raised
# (SystemExit included, in a worker), returned NaN/inf, outlived trainer.reward_timeout_s, ended
# its worker process, or left processes running.
REWARD_FAILURES = ("raised", "non_finite", "timeout", "died", "forked")


@dataclass
class Problem:
    """One prompt: ``prompt`` the plain user message (the backend applies the chat template),
    ``answer`` the reference as text, ``meta`` task-specific."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


class Task(abc.ABC):
    """Training problems, a held-out eval set and an exact verifier. ``eval_set()`` is the same on
    every call and machine; ``sample_train`` never returns an eval problem."""

    name: str = "task"
    # The range every reward of this task lies in (its contract); rewards outside it are
    # counted and warned about once (see :func:`safe_reward`).
    reward_range: Tuple[float, float] = (0.0, 1.0)

    @abc.abstractmethod
    def sample_train(self, n: int, rng: random.Random) -> List[Problem]:
        """``n`` training problems drawn with ``rng`` (a ``random.Random``; an int seeds one)."""

    @abc.abstractmethod
    def eval_set(self) -> List[Problem]:
        """The held-out evaluation problems, identical on every call."""

    @abc.abstractmethod
    def reward(self, problem: Problem, response_text: str) -> float:
        """Score of one response in [0, 1] (1 = verified correct)."""

    def finite_problems(self) -> Optional[Dict[str, List[Problem]]]:
        """Every problem by split ("train", "eval") for a task backed by a finite dataset (checked
        at load: prompt lengths); None for a generated task."""
        return None

    def drop_problems(self, drop: Callable[[Problem], bool]) -> Dict[str, int]:
        """Remove the problems ``drop`` selects from every split; returns how many per split (tasks
        with :meth:`finite_problems` only)."""
        raise NotImplementedError(f"task {self.name!r} cannot drop problems")


class TaskFactory(Protocol):
    """A task's factory: its options (``task.params`` of the run config) -> Task."""

    def __call__(self, **options: Any) -> Task: ...


TASKS: Registry = Registry("task", TaskFactory)


def make_task(name: str, **options) -> Task:
    """Build the registered task ``name`` (an unknown name lists the known ones); the built-ins are
    registered by ``nemo_d3s/tasks/__init__.py``."""
    return TASKS.get(name)(**options)


def as_rng(rng: Union[random.Random, int, None]) -> random.Random:
    """A ``random.Random`` from a generator (as is), an int seed or None."""
    if isinstance(rng, random.Random):
        return rng
    if rng is None or isinstance(rng, int):
        return random.Random(rng)
    raise ValueError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")


# float32 rounds |x| >= 2^128 - 2^103 to inf: its largest value (2 - 2^-23) x 2^127 plus half
# a unit in the last place, where the tie goes to the even neighbour, 2^128 = inf.
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def _finite_in_float32(value: float) -> bool:
    """The reward survives the trainer's float32 rewards tensor (3.5e38 would be inf)."""
    return abs(value) < _FLOAT32_OVERFLOW


def checked_reward(task: Task, problem: Problem, text: str) -> Tuple[float, Optional[str], str]:
    """``task.reward`` that never raises an Exception: (reward, None, "") or, for an exception
    or a value that is not finite (in float32, as the trainer holds rewards: 1e39 would be
    inf there), (0, the reason "raised" / "non_finite", a one-line error)."""
    try:
        value = float(task.reward(problem, text))
    except Exception as exc:  # a verifier bug must not kill a multi-hour run
        first = (str(exc).strip().splitlines() or [""])[0]
        return 0.0, "raised", f"{type(exc).__name__}: {first}"
    if not math.isfinite(value):
        return 0.0, "non_finite", f"non-finite reward {value!r}"
    if not _finite_in_float32(value):
        return 0.0, "non_finite", f"reward {value!r} is beyond float32's range (+-3.4e38)"
    return value, None, ""


def note_reward_range(task: Task, value: float) -> None:
    """Count a reward outside ``task.reward_range`` in ``out_of_range_rewards(task)``; the first
    is logged as a warning."""
    lo, hi = getattr(task, "reward_range", (0.0, 1.0))
    if not lo <= value <= hi and _count_out_of_range(task) == 1:
        log.warning(
            "task %s: reward %r is outside the task's declared range [%s, %s]; further "
            "ones are counted (reward_out_of_range_total in summary.json)",
            getattr(task, "name", task),
            value,
            lo,
            hi,
        )


def safe_reward(task: Task, problem: Problem, text: str) -> Tuple[float, Optional[str]]:
    """``task.reward`` that never raises: an exception or a non-finite value ->
    (0, a one-line error), else (reward, None). A finite reward outside ``task.reward_range`` is
    kept but counted in ``out_of_range_rewards(task)``, the first logged as a warning."""
    value, reason, error = checked_reward(task, problem, text)
    if reason is not None:
        return value, error
    note_reward_range(task, value)
    return value, None


# The count lives on the task. A task with __slots__ has no room for it: its count is kept
# here, keyed by the task's id, with the task itself (so that id stays its own).
_SLOTTED_COUNTS: Dict[int, Tuple[object, int]] = {}


def _count_out_of_range(task: Task) -> int:
    n = out_of_range_rewards(task) + 1
    try:
        task._n_out_of_range = n
    except AttributeError:
        _SLOTTED_COUNTS[id(task)] = (task, n)
    return n


def out_of_range_rewards(task: Task) -> int:
    """How many rewards of ``task`` so far fell outside its ``reward_range``."""
    n = getattr(task, "_n_out_of_range", None)
    return int(n if n is not None else _SLOTTED_COUNTS.get(id(task), (None, 0))[1])
