"""examples/resume.sh (issue 35 item 8): it waits for the run's first checkpoint before the
SIGTERM (a fixed ``sleep 20`` could land before start-up: no checkpoint, the "resume"
restarted at step 0 and ``|| true`` hid it), checks the run stopped with 75, resumes from
the folder alone, and says what went wrong when there is nothing to resume.

The script runs against a stand-in ``python`` on PATH (a training run that writes its
checkpoint after FAKE_DELAY seconds and exits 75 on SIGTERM, like the trainer); the real
one is ``test_example_resume_script_end_to_end`` (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "resume.sh"

# Stands in for `python -m nemo_d3s.train ...`: logs its arguments; a resume=true start
# succeeds only when a checkpoint is there; a first start writes step_000005 after
# FAKE_DELAY seconds (FAKE_EXIT: end with that code before it instead) and answers SIGTERM
# (or SIGINT) with 75, logging whether the checkpoint existed by then.
_FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "args: $*" >> "$FAKE_LOG"
echo "pid: $$" >> "$FAKE_LOG"
out=""
for a in "$@"; do case "$a" in output_dir=*) out=${a#output_dir=} ;; esac; done
ckpt="$out/checkpoints/step_000005"
if [[ " $* " == *" resume=true "* ]]; then
  [[ -d "$ckpt" ]] || { echo "resumed without a checkpoint" >> "$FAKE_LOG"; exit 9; }
  echo "resumed" >> "$FAKE_LOG"; exit 0
fi
trap 'if [[ -d "$ckpt" ]]; then echo "TERM after the checkpoint" >> "$FAKE_LOG";
      else echo "TERM before any checkpoint" >> "$FAKE_LOG"; fi; exit 75' TERM INT
if [[ -n "${FAKE_EXIT:-}" ]]; then exit "$FAKE_EXIT"; fi
sleep "$FAKE_DELAY" </dev/null >/dev/null 2>&1 & wait $!
mkdir -p "$out/checkpoints/.tmp_step_000005"
mv "$out/checkpoints/.tmp_step_000005" "$ckpt"
while true; do sleep 0.05 </dev/null >/dev/null 2>&1 & wait $!; done
"""


def _run(tmp_path: Path, **env_extra: str) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "fake.log"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.update({"FAKE_LOG": str(log), "FAKE_DELAY": "2", **env_extra})
    r = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    return r, log.read_text() if log.exists() else ""


def test_resume_script_signals_only_after_the_first_checkpoint(tmp_path):
    r, log = _run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TERM after the checkpoint" in log and "TERM before" not in log, log
    resumed = f"args: -m nemo_d3s.train output_dir={tmp_path / 'out'} resume=true"
    lines = [x for x in log.strip().splitlines() if not x.startswith("pid:")]
    assert lines[-2:] == [resumed, "resumed"]  # from the folder alone
    assert "stopped (exit code 75); resuming from" in r.stdout


def test_resume_script_run_ending_without_a_checkpoint_is_an_error_and_no_resume(tmp_path):
    r, log = _run(tmp_path, FAKE_EXIT="2")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: the run ended (exit code 2) before writing a checkpoint" in r.stderr
    assert "resume=true" not in log, log


def test_resume_script_gives_up_after_wait_s_and_stops_the_run(tmp_path):
    r, log = _run(tmp_path, FAKE_DELAY="60", WAIT_S="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "error: no checkpoint in" in r.stderr and "after 1 s (WAIT_S)" in r.stderr
    assert "TERM before any checkpoint" in log and "resume=true" not in log, log


def test_resume_script_into_a_folder_holding_a_run_is_refused_before_starting(tmp_path):
    """It started a fresh run there, which the trainer refused ("already holds checkpoints"),
    and then said the run ended "before writing a checkpoint" (misleading: there were some)."""
    (tmp_path / "out" / "checkpoints" / "step_000005").mkdir(parents=True)
    r, log = _run(tmp_path)
    assert r.returncode == 2 and log == "", r.stdout + r.stderr
    assert r.stderr.startswith(f"error: {tmp_path / 'out'} holds files already")
    assert f"output_dir={tmp_path / 'out'} resume=true" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_script_reaches_the_run_and_is_waited_for(tmp_path, sig):
    """SIGTERM or Ctrl-C to the script ended the script and left the run going, unattended;
    now the run gets the signal once, the script waits and exits with its code (75)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(_FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    log = tmp_path / "fake.log"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.update({"FAKE_LOG": str(log), "FAKE_DELAY": "600"})
    # What this test process passes on: in the full suite under xdist a worker was seen with
    # SIGINT ignored or blocked (an earlier test's library), which a shell inherits and cannot
    # trap; the script runs as from a user's terminal: both signals at their defaults.
    inherited = (signal.getsignal(sig), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))

    def as_from_a_terminal():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)

    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=as_from_a_terminal,
    )  # fmt: skip
    for _ in range(int(WAIT_S * 10)):
        if log.exists() and "pid:" in log.read_text():
            break
        time.sleep(0.1)
    run_pid = int(log.read_text().split("pid: ")[1].split()[0])
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 75, (err, "inherited (handler, blocked):", inherited)
    assert log.read_text().count("TERM before any checkpoint") == 1  # delivered once
    assert "the run stopped with exit code 75; continue it with" in err
    for _ in range(100):
        if not Path(f"/proc/{run_pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{run_pid}").exists()


def test_resume_script_header_states_the_exit_codes():
    head = SCRIPT.read_text().split("set -euo pipefail")[0]
    assert "exit 0" not in head.replace("exits 0 when the resumed run finishes", "")
    assert "exits 75" in head and "exits 0 when the resumed run finishes" in head


@pytest.mark.slow
def test_example_resume_script_end_to_end(tmp_path):
    """The real trainer: the first start stops at a checkpoint with 75, the resume finishes
    all 40 steps, each logged once."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "stopped (exit code 75)" in r.stdout and "resumed from" in r.stdout + r.stderr
    import json

    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))
