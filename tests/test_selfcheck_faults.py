"""Issue 32: the self-check's faults: every bad argument or surrounding is one error line
(exit 2), an interrupted or timed-out run still writes selfcheck.json with what finished,
and no scratch folder is left behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _limits import WAIT_S

from nemo_d3s.selfcheck import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("only", ["nosuch", "env,nosuch", ",", ""])
def test_only_naming_no_check_is_refused(only, capsys):
    """It printed "0 passed" and exited 0: a clean bill for a machine nothing checked."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--only", only])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "matches no check; the checks are env.versions" in err, err


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_a_timeout_that_is_not_positive_is_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--timeout", value])
    assert e.value.code == 2 and "is not a number of seconds > 0" in capsys.readouterr().err


def test_out_that_is_a_file_or_unwritable_is_one_error_line(tmp_path, capsys, monkeypatch):
    f = tmp_path / "a_file"
    f.write_text("keep")
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(f), "--only", "env"])
    assert e.value.code == 2 and "is a file; name a folder" in capsys.readouterr().err
    assert f.read_text() == "keep"

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cli.tempfile, "mkstemp", read_only)
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path / "ro"), "--only", "env"])
    assert e.value.code == 2
    assert "is not writable: Read-only file system" in capsys.readouterr().err


def test_a_stray_world_size_is_one_error_line(tmp_path, capsys, monkeypatch):
    """WORLD_SIZE left in the environment (not torchrun) was a traceback from init."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "--only", "env"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT" in err


def test_a_whole_stray_torchrun_environment_is_one_error_line_after_a_bounded_wait(
    tmp_path, capsys, monkeypatch
):
    """WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT all left set, no peer: it waited the
    whole --timeout (15 minutes by default), then a DistStoreError traceback."""
    import socket

    with socket.socket() as s:  # a free port: nobody else is there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    code = cli.main(["--out", str(tmp_path), "--only", "env", "--timeout", "3"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert f"rank 0 of WORLD_SIZE=2 found no peer at 127.0.0.1:{port} within 3 s" in lines[0]
    assert "Traceback" not in err and not (tmp_path / "selfcheck.json").exists()


def test_selfcheck_json_taken_by_a_folder_is_one_error_line(tmp_path, capsys):
    """The checks ran, then writing the results was an IsADirectoryError traceback."""
    (tmp_path / "selfcheck.json").mkdir()
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "--only", "env"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "selfcheck.json' is a folder, where the self-check" in err


@pytest.mark.parametrize("text", ["{not json", '["a list"]', '{"hidden_size": 8}'])
def test_model_with_a_garbage_config_json_blames_the_folder(tmp_path, capsys, text):
    """It read as a machine failure (every model check failed in the table)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(text)
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not a Hugging Face config (the model folder" in err, err


_SLOW_RUN = """
import sys, time
from nemo_d3s.selfcheck import cli, env_checks
from nemo_d3s.selfcheck.base import Check

def slow(ctx):
    time.sleep(600)

cli.all_checks = lambda: [*env_checks.CHECKS[:1], Check("demo.slow", False, slow)]
sys.exit(cli.main(["--out", sys.argv[1], "--ranks", "1", "--cpu"]))
"""


def test_an_interrupted_selfcheck_writes_what_finished_and_leaves_no_scratch(tmp_path):
    """It left .selfcheck_work and no selfcheck.json."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_RUN, str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    progress = out / ".selfcheck_work" / "progress.rank0.jsonl"
    for _ in range(1200):
        if progress.is_file() or proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "error: the self-check was interrupted (SIGTERM)" in stderr
    doc = json.loads((out / "selfcheck.json").read_text())
    assert [(c["name"], c["status"]) for c in doc["checks"]] == [
        ("env.versions", "passed"),
        ("demo.slow", "not run"),
    ]
    assert "interrupted (SIGTERM)" in doc["checks"][1]["reason"]
    assert not (out / ".selfcheck_work").exists()


@pytest.mark.distributed
def test_a_timeout_shorter_than_the_checks_still_writes_selfcheck_json(tmp_path):
    """--timeout shorter than the checks was a TimeoutError traceback and no JSON."""
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.selfcheck", "--out", str(out), "--cpu"]
        + ["--ranks", "2", "--only", "env,gpt", "--timeout", "1"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "error: the self-check ran out of time (--timeout 1 s)" in r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads((out / "selfcheck.json").read_text())
    assert doc["checks"] and all(
        c["status"] == "passed" or "ran out of time" in c["reason"] or c["reason"] == "no CUDA"
        for c in doc["checks"]
    ), doc["checks"]
    assert not (out / ".selfcheck_work").exists()


def test_partial_results_keep_what_every_rank_finished(tmp_path):
    work = tmp_path / ".selfcheck_work"
    work.mkdir()
    rec = {"name": "env.versions", "needs_cuda": False, "status": "passed", "reason": ""}
    (work / "progress.rank0.jsonl").write_text(json.dumps(rec) + "\n")
    (work / "progress.rank1.jsonl").write_text(json.dumps({**rec, "rank": 1}) + "\n{half")
    got = cli._partial(work, ["env.versions", "env.gpus"], "why")
    assert [[r["status"] for r in rows] for rows in got] == [["passed", "not run"]] * 2
    assert got[1][1]["reason"] == "why"
