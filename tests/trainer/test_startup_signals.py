"""A stop signal during the start-up (model build, engine start, checkpoint load: many minutes
at scale), before the loop installs its handlers. Slurm's SIGUSR1, its pre-emption warning,
was ignored there under the sbatch scripts' ``trap "" USR1 TERM`` (and ended the process
outside them): the run trained on into the time limit's SIGKILL, with no checkpoint and no
requeue. It is recorded now and the run stops at its first safe point (docs/faults.md).

The runs go through train.py's ``_run`` in-process (what ``python -m nemo_d3s.train`` runs
after Hydra), with SIGUSR1 ignored first as the sbatch scripts leave it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest

from nemo_d3s import train as train_mod
from nemo_d3s.trainer import checkpoint as checkpoint_mod
from nemo_d3s.trainer import loop as loop_mod
from nemo_d3s.trainer.checkpoint import checkpoint_dirs
from nemo_d3s.trainer.metrics import read_jsonl
from nemo_d3s.trainer.signals import (
    STOPPING,
    StartupStops,
    StopSignals,
    children_ignore_as_started,
)
from nemo_d3s.trainer.step import StepInterrupted

from .conftest import FAST, compose, run_inprocess

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
ARGS = [*FAST, "trainer.reward_workers=0"]


def _signalled_first(monkeypatch, owner, name, signum=signal.SIGUSR1):
    """``owner.name`` sends ``signum`` to this process, then does its work."""
    real = getattr(owner, name)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)


def _cli_run(tmp_path, overrides):
    """(exit code, the handlers the run left) of train.py's ``_run`` started as the sbatch
    scripts start it (SIGUSR1 ignored); this process's handlers are put back after."""
    before = {s: signal.getsignal(s) for s in STOPS}
    cfg = compose(["experiment=smoke", *overrides, f"output_dir={tmp_path}"])
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        with pytest.raises(SystemExit) as e:
            train_mod._run(cfg)
        left = {s: signal.getsignal(s) for s in STOPS}
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert {s: signal.getsignal(s) for s in STOPS} == before
    return e.value.code, left


@pytest.mark.parametrize(
    "moment,eval_at_start",
    [("policy_build", False), ("policy_build", True), ("checkpoint_load", False)],
)
def test_a_sigusr1_during_start_up_stops_the_run_once_it_has_started(
    tmp_path, monkeypatch, capsys, moment, eval_at_start
):
    run_dir = tmp_path / "run"
    args = [*ARGS, f"trainer.eval_at_start={str(eval_at_start).lower()}"]
    resume = []
    if moment == "checkpoint_load":  # a run stopped in its first step: step_000000 to resume
        real_step = loop_mod.run_step

        def interrupted(ctx, step, progress):
            raise StepInterrupted(step)

        monkeypatch.setattr(loop_mod, "run_step", interrupted)
        run_inprocess(run_dir, args)
        monkeypatch.setattr(loop_mod, "run_step", real_step)
        (run_dir / "interrupted.json").unlink()
        resume = ["resume=true"]
        _signalled_first(monkeypatch, checkpoint_mod.CheckpointManager, "load_latest")
    else:
        _signalled_first(monkeypatch, loop_mod, "backend_from_config")
    capsys.readouterr()
    code, left = _cli_run(run_dir, [*args, *resume])
    err = capsys.readouterr().err
    assert code == train_mod.EXIT_INTERRUPTED == 75, err[-3000:]
    assert "SIGUSR1 during start-up: the run stops at a checkpoint once it has started" in err
    assert "stopped at step 0 of 2 (exit code 75: interrupted)" in err
    ckpt = checkpoint_dirs(run_dir / "checkpoints")
    assert [c.name for c in ckpt] == ["step_000000"]
    marker = json.loads((run_dir / "interrupted.json").read_text())
    assert marker == {"step": 0, "signal": "SIGUSR1", "checkpoint": str(ckpt[0])}
    assert read_jsonl(run_dir / "metrics.jsonl") == []  # no step trained
    saved = json.loads((ckpt[0] / "trainer_state.json").read_text())
    assert saved["step"] == 0
    # the start-of-run evaluation the stop cut short is still to do
    assert saved["extra"].get("pending_eval") == (0 if eval_at_start else None)
    # the loop's handlers are gone; the CLI's own is back, the start-up over
    assert all(isinstance(h, StartupStops) and h.taken for h in left.values())
    monkeypatch.undo()
    state, rows = run_inprocess(run_dir, [*args, "resume=true"])
    assert state.step == 2 and [r["step"] for r in rows] == [1, 2]
    evals = [r["step"] for r in read_jsonl(run_dir / "eval.jsonl")]
    assert evals == ([0, 2] if eval_at_start else [2])


def test_a_second_stop_signal_during_start_up_stops_at_once(tmp_path, monkeypatch, capsys):
    """Kept from the loop: a second signal does not wait for a checkpoint."""
    real = loop_mod.backend_from_config

    def twice(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "backend_from_config", twice)
    code, _ = _cli_run(tmp_path / "run", ARGS)
    assert code == 128 + signal.SIGUSR1
    assert "second SIGUSR1 during start-up: stopping now" in capsys.readouterr().err
    assert checkpoint_dirs(tmp_path / "run" / "checkpoints") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_every_stop_signal_of_the_start_up_is_carried_over_to_the_loops_handlers(signum, capsys):
    """SIGTERM ended the process during the start-up (no exit 75, no requeue) and a first
    Ctrl-C was a KeyboardInterrupt: now each is the loop's first stop signal."""
    before = {s: signal.getsignal(s) for s in STOPS}
    after = []
    try:
        # a process started with none of them ignored (an xdist worker starts ignoring
        # SIGINT, which the start-up's handler would then ignore again after the run)
        for s in STOPS:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        startup = StartupStops.arm(lambda s, frame: after.append(s))
        os.kill(os.getpid(), signum)
        stop = StopSignals()
        stop.install()
        assert stop.requested and stop.name == signal.Signals(signum).name
        assert STOPPING == [stop.name]  # train.py's handler ignores what follows the stop
        stop.restore()
        assert {s: signal.getsignal(s) for s in STOPS} == dict.fromkeys(STOPS, startup)
        startup(signum, None)  # after the run: train.py's handler, not the start-up's record
        assert after == [signum]
    finally:
        STOPPING.clear()
        for s, h in before.items():
            signal.signal(s, h)
    assert "during start-up: the run stops at a checkpoint" in capsys.readouterr().err


def test_processes_the_engine_starts_still_ignore_what_the_process_was_started_ignoring():
    """Under sbatch a vLLM engine's processes ignore the job's SIGUSR1 (vLLM handles SIGTERM
    and SIGINT only) and stay awake for the stop path; a caught signal would be the default
    action (the end) in them. Spawned while the start-up's handler catches it, they still
    ignore it; the trainer still catches it meanwhile."""
    before = {s: signal.getsignal(s) for s in STOPS}
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        stops = StartupStops.arm(lambda signum, frame: None)
        ctx = multiprocessing.get_context("spawn")
        with children_ignore_as_started():
            child = ctx.Process(target=signal.raise_signal, args=(signal.SIGUSR1,))
            child.start()
            assert signal.getsignal(signal.SIGUSR1) is stops
        child.join(60)
        assert child.exitcode == 0  # raise_signal returned: SIGUSR1 ignored in the child
        outside = ctx.Process(target=signal.raise_signal, args=(signal.SIGUSR1,))
        outside.start()
        outside.join(60)
        assert outside.exitcode == -signal.SIGUSR1  # what it guards against
    finally:
        for s, h in before.items():
            signal.signal(s, h)
