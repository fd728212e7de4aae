"""Issue 32: a user's reward function (``task.params.reward_fn``) that exits, hangs, is
interrupted, does not load or cannot be called: nothing silent, no traceback, no hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import time

import pytest

from nemo_d3s.config import ConfigError
from nemo_d3s.train import run_cli

from .conftest import FAST, REPO, cli_env, compose
from _limits import WAIT_S  # noqa: E402

DATA = REPO / "examples" / "data" / "sums.jsonl"


def _task(reward_file, fn="score"):
    return [
        "task=jsonl_math",
        f"task.params.train_path={DATA}",
        "task.params.answer_format=plain",
        f"task.params.reward_fn={reward_file}:{fn}",
        "task.eval_size=4",
    ]


def _cfg(tmp_path, body, *extra):
    f = tmp_path / "my_reward.py"
    f.write_text(body)
    return compose(["experiment=smoke", *FAST, *_task(f), f"output_dir={tmp_path / 'run'}", *extra])


@pytest.mark.parametrize(
    "body, what",
    [
        ("import sys\ndef score(r, a):\n    sys.exit(0)\n", "SystemExit(0)"),
        ("def score(r, a):\n    raise KeyboardInterrupt\n", "KeyboardInterrupt()"),
    ],
)
def test_a_reward_function_that_exits_or_raises_keyboardinterrupt_is_one_error_line(
    tmp_path, capsys, body, what
):
    """sys.exit(0) in the function ended the run with exit 0, nothing trained, no summary
    and no message; KeyboardInterrupt was a traceback. In the trainer process
    (reward_workers=0) it is one error line; in a worker it costs the call only."""
    code = run_cli(_cfg(tmp_path, body, "trainer.reward_workers=0"))
    err = capsys.readouterr().err
    assert code == 2, err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and f"the reward function raised {what}" in line[0], err
    assert "Traceback" not in err
    cfg = _cfg(tmp_path, body, "trainer.steps=1", "trainer.max_failed_reward_steps=0")
    cfg.output_dir = str(tmp_path / "workers")
    assert run_cli(cfg) == 0
    rows = [
        json.loads(x) for x in (tmp_path / "workers" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[0]["reward_errors"] == rows[0]["reward_failed_raised"] == rows[0]["n_samples"]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_call_that_never_returns_times_out_and_counts_as_failed(tmp_path, workers):
    """No progress, no timeout before; now each call is cut at trainer.reward_timeout_s and
    counts in reward_errors (the run then stops after max_failed_reward_steps); in a worker
    process the worker is killed and replaced."""
    body = "import time\ndef score(r, a):\n    while True:\n        time.sleep(0.01)\n"
    cfg = _cfg(
        tmp_path,
        body,
        f"trainer.reward_workers={workers}",
        "trainer.reward_timeout_s=0.5",
        "trainer.steps=1",
        "trainer.prompts_per_step=2",
        "trainer.num_generations=2",
        "trainer.max_failed_reward_steps=0",
        "trainer.eval_every=0",
        "task.eval_size=2",
    )
    assert run_cli(cfg) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward_errors"] == 4  # 2 prompts x 2 generations, each cut short
    assert rows[0]["reward_failed_timeout"] == 4


@pytest.mark.parametrize("value", ["-1", "1e20", "nan"])
def test_reward_timeout_is_a_checked_setting(value, capsys):
    """-1 was refused; 1e20 passed and the first reward call was an OverflowError traceback
    (setitimer: timestamp out of range for platform time_t)."""
    from nemo_d3s.config import validate

    with pytest.raises(ConfigError, match=r"trainer.reward_timeout_s.*must be in \[0, 1e\+09\]"):
        validate(compose(["experiment=smoke", f"trainer.reward_timeout_s={value}"]))


def test_reward_workers_is_a_checked_setting():
    from nemo_d3s.config import validate

    with pytest.raises(ConfigError, match=r"trainer.reward_workers.*integer >= 0"):
        validate(compose(["experiment=smoke", "trainer.reward_workers=-1"]))


def test_a_first_sigterm_during_a_hung_reward_call_checkpoints_promptly(tmp_path):
    """A reward that never returns (and no time limit): a first SIGTERM did nothing for
    minutes. Now it interrupts the call; the step is abandoned (redone on resume) and the
    run checkpoints and exits 75."""
    f = tmp_path / "hang.py"
    f.write_text(
        "import pathlib, time\n"
        f"FLAG = pathlib.Path({str(tmp_path / 'in_reward')!r})\n"
        "def score(r, a):\n    FLAG.touch()\n    while True:\n        time.sleep(0.01)\n"
    )
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nemo_d3s.train",
            "experiment=smoke",
            *FAST,
            *_task(f, "score"),
            "trainer.reward_timeout_s=0",
            f"output_dir={out}",
        ],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(1200):
            if (tmp_path / "in_reward").exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert (tmp_path / "in_reward").exists(), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)  # before: still hung after minutes
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-2000:]
    marker = json.loads((out / "interrupted.json").read_text())
    assert marker["step"] == 0 and marker["signal"] == "SIGTERM"


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "def score(r, a)\n    return 1.0\n",
            r"my_reward.py' fails to load \(line 1\): SyntaxError",
        ),
        (
            "import no_such_module_for_rewards\ndef score(r, a):\n    return 1.0\n",
            r"my_reward.py' fails to load \(line 1\): ModuleNotFoundError: No module named",
        ),
        (
            "x = 1 / 0\ndef score(r, a):\n    return 1.0\n",
            r"fails to load \(line 1\): ZeroDivision",
        ),
        ("score = 3\n", r"my_reward.py:score is a int, not a function"),
        (
            "def score(r):\n    return 1.0\n",
            r"called as f\(response, answer\) but its signature is \(r\)",
        ),
        ("def score(r, a, b):\n    return 1.0\n", r"signature is \(r, a, b\)"),
    ],
)
def test_a_reward_file_that_fails_to_load_or_cannot_be_called_is_refused_at_start(
    tmp_path, capsys, body, message
):
    """A syntax error or failing import was a traceback (or read as a data problem); a
    function of the wrong arity failed on every rollout until the run stopped."""
    f = tmp_path / "my_reward.py"
    f.write_text(body)
    cfg = compose(["experiment=smoke", *FAST, *_task(f), f"output_dir={tmp_path / 'run'}"])
    code = run_cli(cfg)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    import re

    assert re.search(message, err) and "task.params.reward_fn" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert os.path.basename(str(f)) in err
