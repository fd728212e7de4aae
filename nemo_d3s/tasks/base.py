"""What a task is: prompts with a verifiable answer, and an exact reward.

Every task is built by a factory registered in ``TASKS`` (one signature:
``factory(**options) -> Task``), so a Hydra override like ``task.name=chain_sum`` picks it.
"""

from __future__ import annotations

import abc
import math
import random
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

from nemo_d3s.core.registry import Registry


@dataclass
class Problem:
    """One prompt. ``prompt`` is the plain user message (the backend applies the chat
    template); ``answer`` is the reference answer as text; ``meta`` is task-specific."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


class Task(abc.ABC):
    """A source of training problems, a fixed held-out eval set, and an exact verifier.

    Contract: ``eval_set()`` returns the same problems on every call and every machine
    (fixed seed), and ``sample_train`` never returns an eval problem.
    """

    name: str = "task"

    @abc.abstractmethod
    def sample_train(self, n: int, rng: random.Random) -> List[Problem]:
        """``n`` training problems drawn with ``rng`` (a ``random.Random``; an int seeds one)."""

    @abc.abstractmethod
    def eval_set(self) -> List[Problem]:
        """The held-out evaluation problems, identical on every call."""

    @abc.abstractmethod
    def reward(self, problem: Problem, response_text: str) -> float:
        """Score of one response in [0, 1] (1 = verified correct)."""


TASKS: Registry = Registry("task", "factory(**options) -> Task")


def make_task(name: str, **options) -> Task:
    """Build the registered task ``name`` (unknown names list the known ones)."""
    # Importing the package registers the built-in tasks.
    import nemo_d3s.tasks  # noqa: F401

    return TASKS.get(name)(**options)


def as_rng(rng: Union[random.Random, int, None]) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    if rng is None or isinstance(rng, int):
        return random.Random(rng)
    raise ValueError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")


def check_count(name: str, n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")


def safe_reward(task: Task, problem: Problem, text: str) -> Tuple[float, Optional[str]]:
    """``task.reward`` that never raises: an exception or a non-finite value gives reward 0
    and a one-line error description (the trainer counts them); else (reward, None)."""
    try:
        value = float(task.reward(problem, text))
    except Exception as exc:  # a verifier bug must not kill a multi-hour run
        return 0.0, f"{type(exc).__name__}: {exc}"
    if not math.isfinite(value):
        return 0.0, f"non-finite reward {value!r}"
    return value, None
