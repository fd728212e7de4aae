"""Rewards in worker processes (``trainer/reward_pool.py``): a reward stuck in one C call, one
whose bare ``except`` swallows every interruption, one that calls ``os._exit``, one that forks
and one that answers after the limit each cost one call (reward 0, a failure counted with its
reason) while the pool goes on, and nothing they started outlives them. In the trainer process
the first two outlived the SIGALRM limit, ``os._exit(0)`` ended the run with exit 0, and a fork
left copies of the trainer holding the run folder's lock."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _limits import WAIT_S  # noqa: E402

from nemo_d3s.tasks.base import REWARD_FAILURES
from nemo_d3s.trainer.metrics import read_jsonl
from nemo_d3s.trainer.run_start.folder import RunDirLock
from nemo_d3s.trainer.tasks_adapter import RewardStopped, task_adapter

from .conftest import FAST, REPO, cli_env

DATA = REPO / "examples" / "data" / "sums.jsonl"
LIMIT = 3.0  # seconds: far above a normal call here, even on a loaded machine

REWARD = """
import os, pathlib, time
LOG = pathlib.Path({log!r})

def note(what):
    with LOG.open("a") as f:
        f.write(what + "\\n")

def score(response, answer):
    note(f"worker {{os.getpid()}} {{os.getsid(0)}}")
    if response == "spin":  # one C call: no bytecode boundary, no signal handler runs
        return float(sum(range(10**13)))
    if response == "swallow":  # catches everything an alarm or a signal could raise
        while True:
            try:
                time.sleep(0.01)
            except:  # noqa: E722
                pass
    if response == "exit":
        os._exit(0)
    if response == "fork":  # a child that would live on, and a copy that returns too
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        note(f"child {{pid}}")
        return 1.0
    if response == "fork-both":
        os.fork()
        return 1.0
    if response == "late":
        time.sleep({late})
        return 1.0
    return 1.0
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _in_sessions(sids) -> list:
    """Live processes in any of the sessions ``sids`` (the workers' and what they forked)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) in sids and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _adapter(tmp_path, workers=2):
    log = tmp_path / "calls.log"
    f = tmp_path / "bad_reward.py"
    f.write_text(REWARD.format(log=str(log), late=LIMIT * 3))
    params = {
        "train_path": str(DATA),
        "answer_format": "plain",
        "reward_fn": f"{f}:score",
        "n_eval": 4,
    }
    return task_adapter("math_file", params, LIMIT, workers), log


def _sessions(log: Path):
    lines = log.read_text().split("\n") if log.exists() else []
    sids = {int(x.split()[2]) for x in lines if x.startswith("worker")}
    children = [int(x.split()[1]) for x in lines if x.startswith("child")]
    return sids, children


def test_each_misbehaving_reward_is_one_counted_failure_and_the_pool_goes_on(tmp_path):
    adapter, log = _adapter(tmp_path)
    try:
        problems = adapter.task.sample_train(2, 0)
        bad = ["spin", "swallow", "exit", "fork", "fork-both", "late"]
        texts = ["ok", *bad, "ok"]  # two prompts x four samples
        rewards, failures = adapter.score(problems, texts, 4)
        assert rewards.tolist() == [1.0, 0, 0, 0, 0, 0, 0, 1.0]
        assert failures == {"timeout": 3, "died": 1, "forked": 2}, failures
        assert set(failures) <= set(REWARD_FAILURES)
        # the pool goes on, with replacements for the killed workers
        rewards, failures = adapter.score(problems, ["ok"] * 8, 4)
        assert rewards.tolist() == [1.0] * 8 and failures == {}
        sids, children = _sessions(log)
        assert children and not any(_alive(p) for p in children)  # killed after their call
        workers = [w.proc.pid for w in adapter.pool.workers]
    finally:
        adapter.close()
    assert len(sids) >= 4  # the first two and the replacements
    assert not any(_alive(p) for p in workers)
    assert _in_sessions(sids) == []  # nothing any worker started is left


def test_a_stop_deadline_cuts_a_hung_call_and_ends_its_worker(tmp_path):
    adapter, log = _adapter(tmp_path, workers=1)
    try:
        problems = adapter.task.sample_train(1, 0)
        adapter.score(problems, ["ok", "ok"], 2)  # the worker is up
        adapter.timeout_s = adapter.pool.timeout_s = 0  # no limit: only the stop cuts it
        old = adapter.pool.workers[0].proc.pid
        adapter.stop_at = time.monotonic() + 1.0
        with pytest.raises(RewardStopped):
            adapter.score(problems, ["ok", "late"], 2)
        assert not _alive(old)
    finally:
        adapter.close()


@pytest.mark.slow
def test_a_run_goes_on_past_rewards_that_exit_fork_or_spin_and_leaves_nothing(tmp_path):
    """Through the command line: the first calls exit the worker, fork a child that would live
    on, and spin in C; the run finishes (exit 0) with those three counted by reason, the forked
    child and every worker gone, the folder's lock free and one metrics row per step."""
    log = tmp_path / "calls.log"
    f = tmp_path / "bad_reward.py"
    f.write_text(
        REWARD.format(log=str(log), late=LIMIT * 3)
        + "\n_score = score\nCOUNT = pathlib.Path({!r})\n".format(str(tmp_path / "count"))
        + "def score(response, answer):\n"
        "    import fcntl\n"
        "    with COUNT.open('a+') as c:\n"
        "        fcntl.flock(c, fcntl.LOCK_EX)\n"
        "        c.seek(0)\n"
        "        n = len(c.read())\n"
        "        c.write('x')\n"
        "    return _score({0: 'exit', 1: 'fork', 2: 'spin'}.get(n, 'ok'), answer)\n"
    )
    out = tmp_path / "run"
    args = [
        "experiment=smoke",
        *FAST,
        "task=jsonl_math",
        f"task.params.train_path={DATA}",
        "task.params.answer_format=plain",
        f"task.params.reward_fn={f}:score",
        f"trainer.reward_timeout_s={LIMIT}",
        f"output_dir={out}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    step1 = rows[0]
    assert step1["reward_errors"] == 3
    assert {k: step1[k] for k in step1 if k.startswith("reward_failed_")} == {
        "reward_failed_died": 1,
        "reward_failed_forked": 1,
        "reward_failed_timeout": 1,
    }
    assert "reward_failed_died" not in rows[1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_errors_total"] == 3
    sids, children = _sessions(log)
    assert children and not any(_alive(p) for p in children)
    assert _in_sessions(sids) == []
    with RunDirLock(out):  # no copy of the trainer holds it
        pass
    assert "Traceback" not in proc.stderr


def test_a_task_a_worker_cannot_build_is_one_error_line(tmp_path, monkeypatch):
    """A task registered only in the trainer process (here: a module deleted after import)."""
    mod = tmp_path / "gone_task_mod.py"
    mod.write_text(
        "from nemo_d3s.tasks.base import TASKS\nfrom nemo_d3s.tasks.tiny import TinyCharTask\n"
        "if 'gone_task' not in TASKS:\n    TASKS.register('gone_task')(TinyCharTask)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_task_mod  # noqa: F401

    mod.unlink()
    adapter = task_adapter("gone_task", {}, LIMIT, 1)
    from nemo_d3s.config import ConfigError

    with pytest.raises(ConfigError, match=r"task 'gone_task' cannot be built in a reward worker"):
        adapter.score(adapter.task.sample_train(1, 0), ["a", "b"], 2)
    assert adapter.pool.workers == []  # closed


def test_the_worker_ignores_stop_signals_and_dies_with_the_trainer(tmp_path):
    """A job's SIGTERM reaches every process: the worker leaves the decision to the trainer;
    a trainer killed with SIGKILL takes its workers along (PR_SET_PDEATHSIG)."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, sys, time\n"
        "from nemo_d3s.trainer.tasks_adapter import task_adapter\n"
        "a = task_adapter('tiny', {}, 0, 1)\n"
        "a.score(a.task.sample_train(1, 0), ['a', 'b'], 2)\n"
        "w = a.pool.workers[0].proc.pid\n"
        "os.kill(w, 15)\n"
        "time.sleep(0.5)\n"
        "print(w, a.score(a.task.sample_train(1, 0), ['a', 'b'], 2)[1], flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=cli_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline().split(maxsplit=1)
        assert len(line) == 2 and line[1].strip() == "{}", line  # SIGTERM: still serving
        worker = int(line[0])
        assert _alive(worker)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
    for _ in range(int(WAIT_S * 10)):
        if not _alive(worker):
            break
        time.sleep(0.1)
    assert not _alive(worker)


def test_a_stop_signal_while_a_worker_starts_neither_kills_it_nor_fails_the_run():
    """Slurm signals every process of the job (proctrack/cgroup), the workers too. One that
    reached a worker before it ignored stop signals (its interpreter starting, ~50 ms) killed
    it, and a worker dying before it is ready is a RunError ("killed by SIGUSR1 while building
    task"): the pre-emption signal failed the run instead of checkpointing it."""
    import os

    adapter = task_adapter("tiny", {}, 0, 1)
    try:
        worker = adapter.pool.workers[0].proc.pid
        for sig in (signal.SIGUSR1, signal.SIGTERM):  # at once: the worker is still starting
            os.kill(worker, sig)
        rewards, failures = adapter.score(adapter.task.sample_train(1, 0), ["a", "b"], 2)
        assert failures == {} and len(rewards) == 2
        assert adapter.pool.workers[0].proc.pid == worker and _alive(worker)  # never replaced
        blocked = Path(f"/proc/{worker}/status").read_text().split("SigBlk:")[1].split()[0]
        assert int(blocked, 16) == 0  # unblocked once it ignores them (and so its children)
    finally:
        adapter.close()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # the trainer's mask restored


def test_a_worker_whose_trainer_stopped_listening_ends_without_a_traceback():
    """The pool closed (a stop, the run's end) while a worker was starting: its first message
    met a closed pipe and printed a BrokenPipeError traceback on the job's stderr."""
    import os

    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    os.close(out_r)  # nobody reads the worker's answers any more
    spec = {"sys_path": sys.path, "cwd": str(REPO), "module": "nemo_d3s.tasks.tiny"}
    spec.update(name="tiny", params={})
    from multiprocessing.connection import Connection

    inbox = Connection(in_w, readable=False)
    inbox.send(("init", spec))
    r = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.tasks.reward_worker", str(in_r), str(out_w)],
        pass_fds=(in_r, out_w),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=WAIT_S,
    )
    inbox.close()
    os.close(in_r)
    os.close(out_w)
    assert r.returncode == 0 and r.stderr == "", r.stderr
