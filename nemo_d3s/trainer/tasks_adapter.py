"""The trainer's view of a task: prompts in, rewards out, failures counted, not fatal.

Rewards are scored by ``trainer.reward_workers`` worker processes (``reward_pool.py``): a call
that raises, returns a non-finite value, outlives ``trainer.reward_timeout_s`` (its worker is
killed), ends its process or leaves processes behind gives reward 0 and counts in
``reward_errors`` (and ``reward_failed_<reason>``). With ``reward_workers=0`` they run in this
process, the time limit a SIGALRM (main thread; a call stuck in one C call or swallowing the
alarm outlives it), and ``SystemExit`` / ``KeyboardInterrupt`` from a reward is an error. After a
stop signal the step's calls get ``STOP_GRACE_S`` more seconds, then raise
:class:`RewardStopped` (the step is redone on resume).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from nemo_d3s.tasks.base import note_reward_range
from nemo_d3s.trainer.reward_pool import RewardPool, worker_spec
from nemo_d3s.trainer.signals import StopNow

__all__ = ["RewardStopped", "TaskAdapter", "build_task", "task_adapter"]

log = logging.getLogger("nemo_d3s.trainer")

_MAX_LOGGED = 5
# After a stop signal, how long the reward calls of the current step may go on before the
# one running is interrupted (a quick verifier finishes the step; a hung one is cut).
STOP_GRACE_S = 2.0


class RewardStopped(BaseException):
    """A stop signal arrived during a reward call (raised by the trainer's signal handler
    into the call; a BaseException so that the function's ``except Exception`` lets it by)."""


class _RewardTimeout(BaseException):
    pass


class TaskAdapter:
    """Wraps a :class:`nemo_d3s.tasks.base.Task`; ``timeout_s``: reward call limit (0: none);
    ``pool``: the workers that score its rewards (None: this process does)."""

    def __init__(
        self, task: Any, timeout_s: float = 0.0, pool: Optional[RewardPool] = None
    ) -> None:
        self.task = task
        self.pool = pool
        self.n_logged = 0
        self.timeout_s = float(timeout_s)
        self.in_reward = False
        self.stop_at: Optional[float] = None  # monotonic time a stop cuts reward calls
        self._timed, self._deadline = False, None

    def close(self) -> None:
        """End the reward workers, if any (the run's end)."""
        if self.pool is not None:
            self.pool.close()

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

    def _in_process(self, problem: Any, completion: str) -> Tuple[float, Optional[str], str]:
        """One call in this process under the SIGALRM limit: (reward, reason, error)."""
        from nemo_d3s.errors import ConfigError
        from nemo_d3s.tasks.base import checked_reward

        try:
            with self._time_limit():
                return checked_reward(self.task, problem, completion)
        except _RewardTimeout:
            msg = f"no answer within {self.timeout_s:g} s (trainer.reward_timeout_s)"
            return 0.0, "timeout", msg
        except (StopNow, RewardStopped):
            raise
        except (SystemExit, KeyboardInterrupt) as e:
            what = f"{type(e).__name__}({e.code if isinstance(e, SystemExit) else ''})"
            raise ConfigError(
                f"task {self.name!r}: the reward function raised {what}, which would end the run "
                "without a summary; a reward function must return a number (raise an Exception "
                "for a failed call: it is counted in reward_errors), or leave "
                "trainer.reward_workers > 0 to run it in worker processes"
            ) from None

    def request_stop(self) -> None:
        """A stop signal arrived: reward calls get :data:`STOP_GRACE_S` more seconds, then (or when
        starting later) raise :class:`RewardStopped`. Re-arms the timer of a call in progress.
        """
        if self.stop_at is not None:
            return
        self.stop_at = time.monotonic() + STOP_GRACE_S
        if self.in_reward and self._timed:  # (a pool's wait reads stop_at every tick)
            signal.setitimer(signal.ITIMER_REAL, min(self._remaining(), STOP_GRACE_S))

    def _remaining(self) -> float:
        ends = [t for t in (self._deadline, self.stop_at) if t is not None]
        return max(1e-3, min(ends) - time.monotonic()) if ends else 0.0

    def _expire(self, _signum, _frame) -> None:
        if self.stop_at is not None and time.monotonic() >= self.stop_at - 1e-3:
            raise RewardStopped()
        if self._deadline is not None and time.monotonic() >= self._deadline - 1e-3:
            raise _RewardTimeout()
        signal.setitimer(signal.ITIMER_REAL, self._remaining())  # woke early: wait on

    @contextmanager
    def _time_limit(self) -> Iterator[None]:
        """The call runs with ``in_reward`` set and, on the main thread, a SIGALRM timer at
        the nearer of its time limit and the stop deadline (see :meth:`request_stop`)."""
        if self.stop_at is not None and time.monotonic() >= self.stop_at:
            raise RewardStopped()
        main = threading.current_thread() is threading.main_thread()
        self._timed = main and hasattr(signal, "setitimer")
        self._deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        if self._timed:
            previous = signal.signal(signal.SIGALRM, self._expire)
            if self._remaining() > 0:
                signal.setitimer(signal.ITIMER_REAL, self._remaining())
        self.in_reward = True
        try:
            yield
        finally:
            self.in_reward = False
            if self._timed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self._timed, self._deadline = False, None

    def score(
        self, problems: Sequence[Any], completions: Sequence[str], n_samples: int
    ) -> Tuple[torch.Tensor, Dict[str, int]]:
        """Rewards [len(problems) * n_samples] f32 for prompt-major completions, and the failed
        calls counted by reason (``tasks.base.REWARD_FAILURES``)."""
        if len(completions) != len(problems) * n_samples:
            raise ValueError(
                f"{len(completions)} completions for {len(problems)} problems x {n_samples} samples"
            )
        items = [(problems[i // n_samples], t) for i, t in enumerate(completions)]
        if self.pool is None:
            results = [self._in_process(p, t) for p, t in items]
        else:
            results = self.pool.score(items, lambda: self.stop_at)
            if results is None:
                raise RewardStopped()
        out, failures = [], {}
        for value, reason, error in results:
            out.append(value)
            if reason is None:
                note_reward_range(self.task, value)
            else:
                failures[reason] = failures.get(reason, 0) + 1
                self._log(error)
        return torch.tensor(out, dtype=torch.float32), failures

    def _log(self, msg: str) -> None:
        if self.n_logged < _MAX_LOGGED:
            log.warning(
                "task %s: reward failed (%s); reward 0, counted in reward_errors", self.name, msg
            )
            self.n_logged += 1
            if self.n_logged == _MAX_LOGGED:
                log.warning("task %s: further reward failures are only counted", self.name)


def task_adapter(name: str, params: dict, timeout_s: float, workers: int) -> TaskAdapter:
    """The task ``name`` built here (prompts, evaluation set) and, with ``workers`` > 0, that
    many reward worker processes started on it (each builds its own copy)."""
    from nemo_d3s.tasks.base import TASKS

    task = build_task(name, params)
    pool = None
    if workers > 0:
        pool = RewardPool(worker_spec(name, params, TASKS.get(name)), workers, timeout_s)
    return TaskAdapter(task, timeout_s=timeout_s, pool=pool)


def build_task(name: str, params: dict) -> Any:
    """The task ``task.name`` with ``task.params``; an unknown task or option, or a bad data row,
    is a :class:`ConfigError` carrying the task's message.
    """
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
