"""A rank whose torchrun agent is killed (kill -9) went on training, unattended; it now sees
its launcher gone and stops as on SIGTERM: a checkpoint, interrupted.json, then it ends.
A run started from a shell is left alone when the shell goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _limits import WAIT_S  # noqa: E402

from nemo_d3s.trainer.launcher import watch_launcher

from .conftest import FAST, REPO, cli_env

# Stands in for torchrun's agent: starts the rank (TORCHELASTIC_RUN_ID set, as torchrun
# sets it), writes its pid, waits on it.
_AGENT = """
import subprocess, sys
rank = subprocess.Popen(sys.argv[2:])
open(sys.argv[1], "w").write(str(rank.pid))
rank.wait()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_rank_whose_agent_is_killed_stops_at_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    agent = tmp_path / "agent.py"
    agent.write_text(_AGENT)
    pidfile = tmp_path / "rank.pid"
    env = {**cli_env(), "TORCHELASTIC_RUN_ID": "test-run"}
    args = [sys.executable, "-m", "nemo_d3s.train", "experiment=smoke", *FAST]
    args += ["trainer.steps=200", "trainer.save_every=0", f"output_dir={out}"]
    proc = subprocess.Popen(
        [sys.executable, str(agent), str(pidfile), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(int(WAIT_S * 10)):  # the first step is logged: training has begun
            m = out / "metrics.jsonl"
            if m.exists() and m.read_text().strip():
                break
            assert proc.poll() is None, "the run ended before its first step"
            time.sleep(0.1)
        rank = int(pidfile.read_text())
        proc.send_signal(signal.SIGKILL)  # the agent, not the rank
        proc.wait(timeout=WAIT_S)
        for _ in range(int(WAIT_S * 10)):
            if not _alive(rank):
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _alive(rank), "the rank is still training without its agent"
    marker = json.loads((out / "interrupted.json").read_text())
    assert marker["signal"] == "SIGTERM" and 0 < marker["step"] < 200
    assert Path(marker["checkpoint"]).is_dir()


def test_no_watch_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_launcher() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    done = watch_launcher(interval_s=0.01)
    assert done is not None and os.getppid() > 0  # our parent lives: no signal
    time.sleep(0.1)
    done.set()
