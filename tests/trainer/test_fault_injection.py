"""Fault injection: kill -9 a real run again and again, at random moments and inside the
lock and checkpoint writes (named fault points, see nemo_d3s.trainer.faults), resuming with
``resume=true`` after every kill; the finished run's metrics and evaluations must equal an
uninterrupted run's (timings aside).

``NEMO_D3S_FAULT_SEED`` picks another random schedule (the default is fixed, so a failure
reproduces).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from nemo_d3s.trainer.checkpoint import checkpoint_dirs, verify_checkpoint
from nemo_d3s.trainer.metrics import read_jsonl

from .conftest import REPO, cli_env, run_inprocess, without_timing
from _limits import WAIT_S  # noqa: E402

STEPS = 60  # enough that no attempt below reaches the end: every one is a kill
RUN = [
    "experiment=smoke",
    f"trainer.steps={STEPS}",
    "trainer.save_every=2",
    "trainer.eval_every=10",
    "trainer.max_new_tokens=16",
    "trainer.keep_last=2",
]


def _schedule(rng: random.Random):
    """(fault spec, None) for a named point (each at a random hit), or (None, (rows, delay)):
    a plain kill -9 ``delay`` seconds after ``rows`` more metric rows appeared, i.e. at a
    random moment of training (a step, an evaluation or a checkpoint write)."""
    points = [
        "lock.acquired",
        f"checkpoint.tmp_created@{rng.randint(1, 3)}",
        f"checkpoint.backend_written@{rng.randint(1, 3)}",
        f"checkpoint.before_rename@{rng.randint(1, 3)}",
        f"checkpoint.renamed@{rng.randint(1, 3)}",
        f"metrics.write@{rng.randint(1, 6)}",
    ]
    plain = [(None, (rng.randint(1, 4), rng.uniform(0.0, 0.15))) for _ in range(5)]
    attempts = [(p, None) for p in points] + plain
    rng.shuffle(attempts)
    return attempts


def _rows(path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref_dir, RUN[1:])  # same arithmetic as the CLI runs: one thread
    rng = random.Random(int(os.environ.get("NEMO_D3S_FAULT_SEED", "0")))
    log = []
    for spec, delay in _schedule(rng):
        env = cli_env()
        if spec:
            env["NEMO_D3S_FAULT"] = spec
        out = (tmp_path / f"attempt{len(log)}.log").open("w")
        # resume=true from the start: with no checkpoint yet it starts from step 0 (a Slurm requeue)
        proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_d3s.train", *RUN, f"output_dir={run_dir}", "resume=true"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        if delay is not None:
            rows, seconds = delay
            start, t0 = _rows(run_dir / "metrics.jsonl"), time.time()
            while proc.poll() is None and time.time() - t0 < 300:
                if (
                    _rows(run_dir / "metrics.jsonl") >= start + rows
                ):  # counts from the resumed step on
                    time.sleep(seconds)
                    break
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        log.append((spec or f"kill {delay[1]:.2f}s after {delay[0]} rows", proc.returncode))
        # every attempt must die by the kill (a run that finished or failed tested nothing)
        assert proc.returncode == -signal.SIGKILL, (
            log,
            (tmp_path / f"attempt{len(log) - 1}.log").read_text()[-3000:],
        )
        for c in checkpoint_dirs(
            run_dir / "checkpoints"
        ):  # a kill never leaves a bad step_* behind
            assert verify_checkpoint(c) is None, (log, c)
        time.sleep(0.05)
    r = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *RUN, f"output_dir={run_dir}", "resume=true"],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows, ref_rows = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(ref_dir / "metrics.jsonl")
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1)), log
    assert without_timing(rows) == without_timing(ref_rows), log
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(
        read_jsonl(ref_dir / "eval.jsonl")
    ), log
    assert (run_dir / "hf_export" / "config.json").is_file()
    for name in ("metrics.jsonl", "eval.jsonl"):  # strict JSONL: every line whole
        text = (run_dir / name).read_text()
        assert text.endswith("\n") and all(
            line.startswith("{") and line.endswith("}") for line in text.splitlines()
        )
