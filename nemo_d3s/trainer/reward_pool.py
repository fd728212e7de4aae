"""Rewards in worker processes: a pool started once per run, fed in batches, each call under a
hard time limit.

A worker (``tasks/reward_worker.py``) is a fresh interpreter (not a fork of the trainer: it
holds none of the trainer's files, locks or signal handlers) in its own session, with its own
copy of the task. A call that outlives ``trainer.reward_timeout_s`` gets its worker killed
(SIGKILL to the worker's process group, so whatever it forked goes too) and replaced; a worker
that ends during a call (``os._exit``, a crash, a signal) is replaced; both cost that call
(reward 0, a counted failure with its reason), never the run. Results come back as JSON.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Deque, List, Optional, Tuple

from nemo_d3s.errors import ConfigError, RunError
from nemo_d3s.tasks.reward_worker import STOP_SIGNALS

__all__ = ["RewardPool", "worker_spec"]

Result = Tuple[float, Optional[str], str]  # (reward, failure reason or None, error line)

# How often the wait wakes to check the time limits and the stop deadline (seconds).
_TICK = 0.1


def worker_spec(name: str, params: dict, factory: Any) -> dict:
    """What a worker needs to build its own copy of task ``name``: the module that registers
    ``factory`` (imported there), the options, this process's ``sys.path`` and folder."""
    module = getattr(factory, "__module__", None) or "nemo_d3s.tasks"
    if module == "__main__":
        raise ConfigError(
            f"task {name!r} is registered by the script being run (__main__), which a reward "
            "worker process cannot import; register it in an importable module, or set "
            "trainer.reward_workers=0 to score rewards in the trainer process"
        )
    return {
        "module": module,
        "name": name,
        "params": params,
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
    }


class _Worker:
    """One worker process and its two pipe ends; ``pending``: the item indices sent to it and
    not answered yet (the first is running since ``started``)."""

    def __init__(self, spec: dict) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        env = dict(os.environ)  # the same nemo_d3s as this process, wherever it came from
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        # Started with the stop signals blocked (a mask survives fork and exec; the worker
        # unblocks them once it ignores them): a job's SIGTERM or SIGUSR1 to every process
        # while the interpreter starts would otherwise kill it, and a worker dying before it is
        # ready fails the run. Blocked in this thread only: one sent to the trainer meanwhile
        # is delivered to another of its threads or on return, not lost.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nemo_d3s.tasks.reward_worker", str(in_r), str(out_w)],
                pass_fds=(in_r, out_w),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(in_r)
            os.close(out_w)
        self.inbox = Connection(in_w, readable=False)
        self.outbox = Connection(out_r, writable=False)
        self.ready = False
        self.pending: List[int] = []
        self.started = 0.0
        self.inbox.send(("init", spec))

    def kill(self) -> Optional[int]:
        """SIGKILL to the worker's process group (what it forked included); its exit code."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = self.proc.wait()
        for conn in (self.inbox, self.outbox):
            conn.close()
        return code


def _ending(code: Optional[int]) -> str:
    """How a worker ended, in words."""
    if code is None:
        return "ended"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} (os._exit or a crash in the reward function)"


class RewardPool:
    """``n`` workers for the task ``spec`` describes (:func:`worker_spec`), started at once; each
    call limited to ``timeout_s`` seconds (0: none). :meth:`score` is called from the main thread
    (a worker dies with the thread that started it), :meth:`close` at the run's end."""

    def __init__(self, spec: dict, n: int, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, float(timeout_s)
        self.batch = 0
        self.workers = [_Worker(spec) for _ in range(n)]

    def score(
        self, items: List[Tuple[Any, str]], stop_at: Callable[[], Optional[float]]
    ) -> Optional[List[Result]]:
        """(reward, reason, error) for each (problem, text), in order; None when the stop
        deadline ``stop_at()`` (monotonic seconds, or None) passed first (the calls still running
        are killed)."""
        if not self.workers:
            raise RuntimeError("the reward pool is closed")
        self.batch += 1
        results: List[Optional[Result]] = [None] * len(items)
        todo: Deque[int] = collections.deque(range(len(items)))
        # a few chunks per worker: balanced when calls differ in cost, few round trips
        chunk = max(1, math.ceil(len(items) / (2 * len(self.workers))))
        left = len(items)
        while left:
            now = time.monotonic()
            for w in self.workers:  # feed the idle ones
                if w.ready and not w.pending and todo:
                    w.pending = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                    w.started = now
                    w.inbox.send(("batch", self.batch, [(i, *items[i]) for i in w.pending]))
            for w in list(self.workers):
                if w.pending and self.timeout_s and now - w.started > self.timeout_s:
                    self._replace(w, todo)
                    results[w.pending[0]] = (
                        0.0,
                        "timeout",
                        f"no answer within {self.timeout_s:g} s (trainer.reward_timeout_s); "
                        "its worker process was killed and replaced",
                    )
                    left -= 1
            stop = stop_at()
            if stop is not None and now >= stop:
                for w in list(self.workers):
                    if w.pending:
                        self._replace(w, todo)
                return None
            for conn in wait([w.outbox for w in self.workers], self._wait_s(now, stop)):
                w = next(x for x in self.workers if x.outbox is conn)
                left -= self._receive(w, results, todo)
            for w in list(self.workers):  # ended without EOF: a child of it holds the pipe
                if w.proc.poll() is not None and w in self.workers:
                    left -= self._ended(w, results, todo)
        return [r for r in results if r is not None]

    def _wait_s(self, now: float, stop: Optional[float]) -> float:
        ends = [w.started + self.timeout_s for w in self.workers if w.pending and self.timeout_s]
        ends += [] if stop is None else [stop]
        return max(0.0, min([now + _TICK, *ends]) - now)

    def _receive(self, w: "_Worker", results: List[Optional[Result]], todo: Deque[int]) -> int:
        """Read everything ``w`` has sent; the number of results it completed."""
        done = 0
        while True:
            try:
                msg = json.loads(w.outbox.recv_bytes().decode("utf-8"))
            except (EOFError, OSError):
                return done + self._ended(w, results, todo)
            done += self._take(w, msg, results)
            if not w.outbox.poll(0):
                return done

    def _take(self, w: "_Worker", msg: Any, results: List[Optional[Result]]) -> int:
        if isinstance(msg, dict):
            if "failed" in msg:
                self.close()
                raise ConfigError(
                    f"task {self.spec['name']!r} cannot be built in a reward worker process "
                    f"({msg['failed']}); set trainer.reward_workers=0 to score rewards in the "
                    "trainer process"
                )
            w.ready = True
            return 0
        batch, i, value, reason, error = msg
        if batch != self.batch or i not in w.pending:
            return 0
        w.pending.remove(i)
        w.started = time.monotonic()
        results[i] = (float(value), reason, str(error))
        return 1

    def _ended(self, w: "_Worker", results: List[Optional[Result]], todo: Deque[int]) -> int:
        """``w`` ended on its own: its running call fails, the rest go to its replacement."""
        if not w.ready:
            code = self._replace(w, todo)
            self.close()
            raise RunError(
                f"a reward worker process {_ending(code)} while building task "
                f"{self.spec['name']!r}; set trainer.reward_workers=0 to score rewards in the "
                "trainer process"
            )
        running = w.pending[0] if w.pending else None
        code = self._replace(w, todo)
        if running is None:
            return 0
        results[running] = (0.0, "died", f"its reward worker {_ending(code)} during the call")
        return 1

    def _replace(self, w: "_Worker", todo: Deque[int]) -> Optional[int]:
        """Kill ``w``, queue its unanswered calls but the running one first, start another;
        ``w``'s exit code (its own, when it had ended before the kill)."""
        code = w.proc.poll()
        killed = w.kill()
        todo.extendleft(reversed(w.pending[1:]))
        self.workers[self.workers.index(w)] = _Worker(self.spec)
        return killed if code is None else code

    def close(self) -> None:
        """Kill every worker and what it left (idempotent; the pool is unusable after)."""
        for w in self.workers:
            w.kill()
        self.workers = []
