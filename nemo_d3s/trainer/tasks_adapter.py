"""The trainer's view of a task: prompts in, rewards out, failures counted not fatal.

A reward function that raises or returns a non-finite value must not crash a long run nor
poison the advantages (NaN would spread through the whole group): the sample gets reward
0, the failure is counted in the step's ``reward_errors`` metric, and the first few are
logged with the exception text.

A call that does not return within ``trainer.reward_timeout_s`` is cut short (SIGALRM,
on the main thread) and counted the same way. A stop signal that arrives during a call
interrupts it (:class:`RewardStopped`: the step is abandoned and redone on resume). A
reward function that raises ``SystemExit`` (``sys.exit``) or ``KeyboardInterrupt`` is a
bug of the function, not a stop: one error line naming it (it used to end the run with
exit 0 and nothing written, or a traceback).
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, List, Sequence, Tuple

import torch

__all__ = ["RewardStopped", "StopNow", "TaskAdapter", "build_task"]

log = logging.getLogger("nemo_d3s.trainer")

_MAX_LOGGED = 5


class RewardStopped(BaseException):
    """A stop signal arrived during a reward call (raised by the trainer's signal handler
    into the call; a BaseException so that the function's ``except Exception`` lets it by)."""


class StopNow(SystemExit):
    """The trainer's second stop signal: exit at once (128 + signal), never a reward bug."""


class _RewardTimeout(BaseException):
    pass


class TaskAdapter:
    """Wraps a :class:`nemo_d3s.tasks.base.Task` (``sample_train(n, rng)``, ``eval_set()``,
    ``reward(problem, text)``; problems carry a plain-text ``prompt``). ``timeout_s``: the
    limit of one reward call (0 = none)."""

    def __init__(self, task: Any, timeout_s: float = 0.0) -> None:
        self.task = task
        self.n_logged = 0
        self.timeout_s = float(timeout_s)
        self.in_reward = False  # read by the trainer's signal handler

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
        from nemo_d3s.errors import ConfigError
        from nemo_d3s.tasks.base import safe_reward

        try:
            with self._time_limit():
                value, error = safe_reward(self.task, problem, completion)
        except _RewardTimeout:
            value = 0.0
            error = f"no answer within {self.timeout_s:g} s (trainer.reward_timeout_s)"
        except (StopNow, RewardStopped):
            raise
        except (SystemExit, KeyboardInterrupt) as e:
            what = f"{type(e).__name__}({e.code if isinstance(e, SystemExit) else ''})"
            raise ConfigError(
                f"task {self.name!r}: the reward function raised {what}, which would end the run "
                "without a summary; a reward function must return a number (raise an Exception "
                "for a failed call: it is counted in reward_errors)"
            ) from None
        if error is not None:
            self._log(error)
        return value, error is not None

    @contextmanager
    def _time_limit(self) -> Iterator[None]:
        """The call runs with ``in_reward`` set (a stop signal then interrupts it) and, on
        the main thread with a limit, a SIGALRM timer that raises into it."""
        main = threading.current_thread() is threading.main_thread()
        timed = main and self.timeout_s > 0 and hasattr(signal, "setitimer")
        if timed:

            def expire(_signum, _frame):
                raise _RewardTimeout()

            previous = signal.signal(signal.SIGALRM, expire)
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        self.in_reward = True
        try:
            yield
        finally:
            self.in_reward = False
            if timed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)

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
