"""A reward worker process: ``python -m nemo_d3s.tasks.reward_worker IN_FD OUT_FD``, started by
the trainer's reward pool (``trainer/reward_pool.py``), scores (problem, response) pairs with its
own copy of the task.

Protocol. From the trainer on ``IN_FD`` (``multiprocessing.connection`` frames, pickled: the
trainer is this process's only writer): ``("init", spec)``, then ``("batch", id, [(i, problem,
text), ...])`` any number of times. To the trainer on ``OUT_FD``, JSON only (the trainer reads
nothing a reward function could shape into code): ``{"ready": pid}`` or ``{"failed": why}`` after
the task is built, then ``[id, i, value, reason, error]`` per call as it finishes (``reason``:
null, or why the call failed: ``raised``, ``non_finite``, ``forked``).

The process is its own session (the trainer passes ``start_new_session``): a terminal's Ctrl-C
or a job's SIGTERM is the trainer's to act on, so stop signals are caught and ignored here; it
dies with the trainer (``PR_SET_PDEATHSIG``), and adopts what a reward leaves behind
(``PR_SET_CHILD_SUBREAPER``) so that a call which leaves a process running fails and the
process is killed.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, List, Optional, Tuple

from nemo_d3s.tasks.base import checked_reward

# The signals a job or a terminal stops the trainer with: the trainer's to act on, never the
# worker's (reward_pool starts a worker with them blocked until it ignores them).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)

__all__ = ["main", "reap_children"]

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _build(spec: dict) -> Any:
    """The task ``spec["name"]`` with its options, once the module registering it is imported
    (with the trainer's ``sys.path``, in the trainer's folder: relative paths mean the same)."""
    from nemo_d3s.tasks.base import make_task

    sys.path[:] = spec["sys_path"]
    os.chdir(spec["cwd"])
    importlib.import_module(spec["module"])
    return make_task(spec["name"], **spec["params"])


def _children() -> List[int]:
    """Pids of this process's live or unreaped children (every thread's)."""
    out: List[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def reap_children() -> List[int]:
    """Kill (SIGKILL) and reap every process a reward call left behind, running or exited
    (its children, and the orphans it left, adopted as a subreaper); their pids. One syscall
    when there are none."""
    try:  # any child at all? (WNOWAIT: an exited one stays to be counted)
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, AttributeError):  # none, or no waitid (not Linux)
        return []
    found: List[int] = []
    for _ in range(100):  # a killed child's own children are adopted next round
        kids = _children()
        if not kids:
            break
        found += [p for p in kids if p not in found]
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return found


def _score(task: Any, problem: Any, text: str) -> Tuple[float, Optional[str], str]:
    me = os.getpid()
    try:
        value, reason, error = checked_reward(task, problem, text)
    except BaseException as e:  # SystemExit, KeyboardInterrupt: this call fails, not the worker
        what = e.code if isinstance(e, SystemExit) else ""
        value, reason = 0.0, "raised"
        error = f"the reward function raised {type(e).__name__}({what})"
    if os.getpid() != me:  # a copy the reward forked returned here: it must not answer
        os._exit(0)
    left = reap_children()
    if left:
        value, reason = 0.0, "forked"
        error = (
            f"the reward function left {len(left)} process(es) behind (pid "
            f"{', '.join(map(str, left[:3]))}): forked and not waited for; killed"
        )
    return value, reason, error


def main(in_fd: int, out_fd: int) -> None:
    """Serve the trainer until it closes ``in_fd`` (or dies: then this process is killed)."""
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(1)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: None)  # default again after an exec
    # the trainer started this process with them blocked: one sent before the line above
    # (a job's SIGTERM during the interpreter's start) is pending, delivered now to a no-op
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    inbox, outbox = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    try:
        kind, spec = inbox.recv()
        task = _build(spec)
    except EOFError:
        return
    except BaseException as e:  # the user's task or module: say why, then end
        first = (str(e).strip().splitlines() or [""])[0]
        outbox.send_bytes(json.dumps({"failed": f"{type(e).__name__}: {first}"}).encode())
        return
    try:
        outbox.send_bytes(json.dumps({"ready": os.getpid()}).encode())
        while True:
            _, batch, items = inbox.recv()
            for i, problem, text in items:
                value, reason, error = _score(task, problem, text)
                outbox.send_bytes(json.dumps([batch, i, value, reason, error]).encode())
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # the trainer closed the pool or ended (a stop, a kill) while this one was starting
        # or scoring: nothing more to say, and no traceback on the job's stderr
        return


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
