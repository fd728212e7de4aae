"""The trainer's view of a task: prompts in, rewards out, failures counted not fatal.

A reward function that raises or returns a non-finite value must not crash a long run nor
poison the advantages (NaN would spread through the whole group): the sample gets reward
0, the failure is counted in the step's ``reward_errors`` metric, and the first few are
logged with the exception text.
"""

from __future__ import annotations

import logging
from typing import Any, List, Sequence, Tuple

import torch

__all__ = ["TaskAdapter", "build_task"]

log = logging.getLogger("nemo_d3s.trainer")

_MAX_LOGGED = 5


class TaskAdapter:
    """Wraps a :class:`nemo_d3s.tasks.base.Task` (``sample_train(n, rng)``, ``eval_set()``,
    ``reward(problem, text)``; problems carry a plain-text ``prompt``)."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.n_logged = 0

    @property
    def name(self) -> str:
        return str(getattr(self.task, "name", type(self.task).__name__))

    def sample_train(self, n: int, seed: int) -> List[Any]:
        problems = list(self.task.sample_train(n, seed))
        if len(problems) != n:
            raise RuntimeError(
                f"task {self.name!r}: sample_train({n}) returned {len(problems)} problems"
            )
        return problems

    def eval_set(self, n: int) -> List[Any]:
        """The first ``n`` problems of the task's fixed held-out set (all, if it has fewer)."""
        problems = list(self.task.eval_set())
        if len(problems) < n:
            log.warning(
                "task %s: eval set has %d problems (task.eval_size=%d); using all",
                self.name,
                len(problems),
                n,
            )
        return problems[:n]

    @staticmethod
    def prompt_text(problem: Any) -> str:
        return problem.prompt

    def reward_one(self, problem: Any, completion: str) -> Tuple[float, bool]:
        """(reward, failed). ``failed`` when the reward function raised or returned NaN/inf
        (the reward is then 0, see ``tasks.base.safe_reward``)."""
        from nemo_d3s.tasks.base import safe_reward

        value, error = safe_reward(self.task, problem, completion)
        if error is not None:
            self._log(error)
        return value, error is not None

    def score(
        self, problems: Sequence[Any], completions: Sequence[str], n_samples: int
    ) -> Tuple[torch.Tensor, int]:
        """Rewards [len(problems) * n_samples] f32 for prompt-major completions, and the
        number of failed reward calls."""
        if len(completions) != len(problems) * n_samples:
            raise ValueError(
                f"{len(completions)} completions for {len(problems)} problems x {n_samples} samples"
            )
        out, errors = [], 0
        for i, text in enumerate(completions):
            r, failed = self.reward_one(problems[i // n_samples], text)
            out.append(r)
            errors += failed
        return torch.tensor(out, dtype=torch.float32), errors

    def _log(self, msg: str) -> None:
        if self.n_logged < _MAX_LOGGED:
            log.warning(
                "task %s: reward failed (%s); reward 0, counted in reward_errors", self.name, msg
            )
            self.n_logged += 1
            if self.n_logged == _MAX_LOGGED:
                log.warning("task %s: further reward failures are only counted", self.name)


def build_task(name: str, params: dict) -> Any:
    """Construct the task ``name`` from the tasks registry (``task.name`` / ``task.params``).
    An option the task does not take, an unknown task, or a bad data row (e.g. one without
    an answer) becomes a :class:`ConfigError` carrying the task's message."""
    from nemo_d3s.errors import ConfigError
    from nemo_d3s.tasks.base import make_task

    try:
        return make_task(name, **params)
    except TypeError as e:
        raise ConfigError(f"task.params for task {name!r}: {e}") from None
    except ValueError as e:  # bad options or bad data rows: the task's message names them
        msg = str(e)
        raise ConfigError(
            msg if msg.startswith(f"task {name!r}") else f"task {name!r}: {msg}"
        ) from None
