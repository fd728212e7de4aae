"""Checkpoints: atomic layout and pruning, resume after SIGKILL equals an uninterrupted run,
SIGTERM writes a checkpoint and exits 75 (interrupted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_d3s.trainer.checkpoint import CheckpointManager, TrainerState, latest_checkpoint
from nemo_d3s.distributed.groups import ParallelGroups as DPInfo
from nemo_d3s.trainer.metrics import read_jsonl

from nemo_d3s.config import ConfigError
from nemo_d3s.tasks.base import TASKS
from nemo_d3s.tasks.tiny import TinyCharTask
from nemo_d3s.train import EXIT_INTERRUPTED

from .conftest import REPO, cli, cli_env, run_inprocess, without_timing
from _limits import WAIT_S  # noqa: E402

RUN = [
    "experiment=smoke",
    "trainer.steps=8",
    "trainer.save_every=2",
    "trainer.eval_every=4",
    "trainer.max_new_tokens=16",
    "trainer.keep_last=2",
]


class _StateBackend:
    def __init__(self):
        self.w = torch.zeros(3)

    def state_dict(self):
        return {"w": self.w.clone()}

    def load_state_dict(self, s):
        self.w = s["w"].clone()

    def save_checkpoint(
        self, folder
    ):  # the Policy defaults: replicated state, saved by the trainer
        return False

    def load_checkpoint(self, folder):
        return False


def test_checkpoint_manager_atomic_prune_and_restore(tmp_path):
    be = _StateBackend()
    mgr = CheckpointManager(str(tmp_path), DPInfo(), keep_last=2)
    for step in (1, 2, 3):
        be.w += 1
        mgr.save(be, TrainerState(step=step, update_tokens_total=10.0 * step))
    # a half-written checkpoint of a later step (killed mid-save) is ignored
    (tmp_path / "checkpoints" / ".tmp_step_000004").mkdir()
    (tmp_path / "checkpoints" / "step_000005").mkdir()  # no trainer_state.json: incomplete
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step_000001" not in names and {"step_000002", "step_000003"} <= set(names)
    latest = latest_checkpoint(tmp_path / "checkpoints")
    assert latest.name == "step_000003"
    torch.manual_seed(123)
    expected = torch.rand(2)
    fresh = _StateBackend()
    state = mgr.load(latest, fresh)  # restores the RNG captured at save time, too
    assert state.step == 3 and state.update_tokens_total == 30.0
    assert torch.equal(fresh.w, torch.full((3,), 3.0))
    assert not torch.equal(torch.rand(2), expected)


def test_a_save_after_falling_back_keeps_the_good_checkpoints_not_the_corrupt_newer_one(tmp_path):
    # keep_last=1: pruning by step number alone kept the corrupt step 20 and deleted the step 12
    # just written and the step 10 the run came from: the next resume had nothing to load
    be = _StateBackend()
    mgr = CheckpointManager(str(tmp_path), DPInfo(), keep_last=3)
    for step in (10, 20):
        mgr.save(be, TrainerState(step=step))
    bad = tmp_path / "checkpoints" / "step_000020" / "backend.pt"
    bad.write_bytes(bad.read_bytes()[:-1] + b"x")
    mgr.keep_last = 1
    path, state = mgr.load_latest(_StateBackend())
    assert path.name == "step_000010" and state.step == 10
    mgr.save(be, TrainerState(step=12))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000012"]
    assert mgr.load_latest(_StateBackend())[1].step == 12
    mgr.keep_last = 2  # the rewound history's steps count no more once passed
    mgr.save(be, TrainerState(step=25))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000012", "step_000025"]


@pytest.mark.parametrize("case", ["backend_types", "rng_size", "state_types"])
def test_a_checkpoint_whose_checksums_match_but_contents_do_not_fit_is_an_error_naming_it(
    tmp_path, case
):
    """Checksums that match (a crafted or foreign checkpoint) and contents of the wrong kind:
    one RunError naming the file, not a traceback from deep in the load (an AttributeError,
    torch's RuntimeError on a generator state of the wrong size, a counter that is a string)."""
    from nemo_d3s.errors import RunError
    from nemo_d3s.files import write_checksums
    from nemo_d3s.trainer.checkpoint import CHECKSUMS, verify_checkpoint

    mgr = CheckpointManager(str(tmp_path), DPInfo(), keep_last=2)
    ckpt = mgr.save(_StateBackend(), TrainerState(step=1))
    if case == "backend_types":
        torch.save({"w": [1.0, 2.0, 3.0]}, ckpt / "backend.pt")  # a list, not a tensor
    elif case == "rng_size":
        rng = torch.load(ckpt / "rng_rank0.pt", weights_only=True)
        rng["torch"] = rng["torch"][:100]
        torch.save(rng, ckpt / "rng_rank0.pt")
    else:
        raw = json.loads((ckpt / "trainer_state.json").read_text())
        raw["skipped_steps"] = "3"
        (ckpt / "trainer_state.json").write_text(json.dumps(raw))
    (ckpt / CHECKSUMS).unlink()
    write_checksums(ckpt)
    if case == "state_types":
        assert "skipped_steps='3'" in verify_checkpoint(ckpt)
        with pytest.raises(RunError, match="no usable checkpoint.*skipped_steps"):
            mgr.load_latest(_StateBackend())
        return
    name = "backend.pt" if case == "backend_types" else "rng_rank0.pt"
    with pytest.raises(RunError, match=f"step_000001.*{name}|{name}|does not fit") as e:
        mgr.load(ckpt, _StateBackend())
    assert str(ckpt) in str(e.value)


def test_a_kill_while_deleting_an_old_copy_leaves_the_new_checkpoint_whole(tmp_path, monkeypatch):
    """A step saved twice (a stop signal's save after the scheduled one) and a kill -9 while
    the old copy is deleted: the deletion only ever touches a copy moved aside, so the
    published step_* is the new, complete checkpoint (it was rmtree'd in place: half of it
    could be gone under its final name)."""
    import shutil

    from nemo_d3s.formats.checksums import verify_checksums
    from nemo_d3s.trainer import checkpoint

    be = _StateBackend()
    mgr = CheckpointManager(str(tmp_path), DPInfo(), keep_last=2)
    mgr.save(be, TrainerState(step=2))
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # deletes one file, then the process "dies"
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        if files:
            files[0].unlink()
        raise KeyboardInterrupt

    be.w += 1
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(be, TrainerState(step=2, update_tokens_total=5.0))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    final = tmp_path / "checkpoints" / "step_000002"
    verify_checksums(final)
    assert latest_checkpoint(tmp_path / "checkpoints") == final
    fresh = _StateBackend()
    assert mgr.load(final, fresh).update_tokens_total == 5.0
    assert torch.equal(fresh.w, torch.ones(3))
    mgr.save(be, TrainerState(step=3))  # the next save's prune removes what was left aside
    assert not list((tmp_path / "checkpoints").glob(".pruned_*"))


@pytest.mark.parametrize("written", [True, False])
def test_a_kill_between_the_renames_of_a_step_saved_again_loses_neither_copy(
    tmp_path, monkeypatch, written
):
    """The old copy of a step saved again went aside, then the kill came before the new copy
    was renamed in: no step_N, and nothing brought either copy back (the resume fell back to
    an older checkpoint or started afresh). The load now takes the new copy when its
    checksums were written (the last file), else the old one."""
    from nemo_d3s.trainer import checkpoint
    from nemo_d3s.trainer.checkpoint import CHECKSUMS

    be = _StateBackend()
    mgr = CheckpointManager(str(tmp_path), DPInfo(), keep_last=2)
    mgr.save(be, TrainerState(step=2))
    real = checkpoint.os.replace

    def killed_before_the_second(src, dst):
        if Path(src).name.startswith(".tmp_"):
            raise KeyboardInterrupt
        return real(src, dst)

    be.w += 1
    monkeypatch.setattr(checkpoint.os, "replace", killed_before_the_second)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(be, TrainerState(step=2, update_tokens_total=5.0))
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert not (root / "step_000002").exists() and (root / ".pruned_step_000002").is_dir()
    if not written:  # a new copy without its checksums (the last file) is not complete
        (root / ".tmp_step_000002" / CHECKSUMS).unlink()
    fresh = _StateBackend()
    path, state = mgr.load_latest(fresh)
    assert path.name == "step_000002"
    assert state.update_tokens_total == (5.0 if written else 0.0)
    assert torch.equal(fresh.w, torch.full((3,), 1.0 if written else 0.0))


def test_the_records_are_on_disk_before_each_checkpoint_is_published(tmp_path, monkeypatch):
    """metrics.jsonl and eval.jsonl were written without a flush: a crash of the node after a
    checkpoint's rename could drop rows up to its step, which the resume never writes again."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("publish", Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run_inprocess(tmp_path, ["trainer.steps=2", "trainer.save_every=1", "trainer.eval_every=1"])
    monkeypatch.undo()
    published = [i for i, e in enumerate(events) if e[0] == "publish" and e[1].startswith("step_")]
    assert len(published) == 2
    start = 0
    for i in published:
        flushed = {Path(p).name for kind, p in events[start:i] if kind == "fsync"}
        assert {"metrics.jsonl", "eval.jsonl"} <= flushed, events[start:i]
        start = i


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = WAIT_S) -> None:
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended (rc={proc.returncode}) before {path} appeared:\n{proc.stderr.read()}"
            )
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.005)


def _popen(args, log: Path):
    # stdout (Hydra's console log) to a file: a full pipe would block the child.
    return subprocess.Popen(
        [sys.executable, "-m", "nemo_d3s.train", *args],
        cwd=REPO,
        env=cli_env(),
        stdout=log.open("w"),
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # a whole program run (or several): the slow tier
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref_dir, RUN[1:])  # the uninterrupted reference (same arithmetic: 1 thread)

    proc = _popen([*RUN, f"output_dir={run_dir}"], tmp_path / "killed.log")
    _wait_for(run_dir / "checkpoints" / "step_000002" / "trainer_state.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "checkpoints" / "step_000008").exists(), (
        "killed too late to test anything"
    )
    killed_at = len(read_jsonl(run_dir / "metrics.jsonl"))

    r = cli([*RUN, f"output_dir={run_dir}", "resume=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    ref_rows, rows = read_jsonl(ref_dir / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 8, f"killed after {killed_at} rows"
    assert without_timing(rows) == without_timing(ref_rows)
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(
        read_jsonl(ref_dir / "eval.jsonl")
    )
    assert (run_dir / "hf_export" / "config.json").is_file()


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_sigterm_saves_a_checkpoint_and_exits_with_the_interrupted_code(tmp_path):
    """Not 0: `train && convert` must not go on after a stop; the code and the marker file
    are what the sbatch scripts requeue on."""
    run_dir = tmp_path / "run"
    proc = _popen(
        [*RUN, "trainer.steps=40", "trainer.save_every=100", f"output_dir={run_dir}"],
        tmp_path / "out.log",
    )
    _wait_for(run_dir / "metrics.jsonl", proc)
    while not read_jsonl(run_dir / "metrics.jsonl"):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == EXIT_INTERRUPTED == 75, err[-3000:]
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None, err[-3000:]
    state = json.loads((latest / "trainer_state.json").read_text())
    assert 0 < state["step"] < 40
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == state["step"]
    assert "received SIGTERM" in (tmp_path / "out.log").read_text()
    assert (
        f"stopped at step {state['step']} of 40 (exit code 75: interrupted); continue with "
        "resume=true" in err
    )
    marker = json.loads((run_dir / "interrupted.json").read_text())
    assert marker == {"step": state["step"], "signal": "SIGTERM", "checkpoint": str(latest)}


@pytest.mark.slow  # a whole program run (or several): the slow tier
def test_sigterm_during_generation_stops_within_a_token_and_resumes_exactly(tmp_path):
    """SIGTERM arrives while step 3's rollouts are being decoded (fault point engine.decode,
    passed before every token): the run drops the partial rollouts, checkpoints the state
    after step 2 and exits 75 (interrupted); resume=true redoes step 3 and ends with the
    uninterrupted run's metrics and evaluations."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref_dir, RUN[1:])
    env = cli_env()
    # a check before every chunk and every token (<= 16 per call): the 40th falls in the
    # first steps' generation (or the evaluation at start; both must resume exactly)
    env["NEMO_D3S_FAULT"] = "engine.decode@40=term"
    r = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *RUN, f"output_dir={run_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == EXIT_INTERRUPTED, r.stderr[-3000:]
    assert (run_dir / "interrupted.json").is_file()
    state = json.loads(
        (latest_checkpoint(run_dir / "checkpoints") / "trainer_state.json").read_text()
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert state["step"] < 8 and (not rows or rows[-1]["step"] == state["step"]), (state, len(rows))
    assert "received SIGTERM" in r.stdout + r.stderr
    r = cli([*RUN, f"output_dir={run_dir}", "resume=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (
        run_dir / "interrupted.json"
    ).exists()  # the resumed run removed the earlier stop's marker
    assert without_timing(read_jsonl(run_dir / "metrics.jsonl")) == without_timing(
        read_jsonl(ref_dir / "metrics.jsonl")
    )
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(
        read_jsonl(ref_dir / "eval.jsonl")
    )


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    args = ["trainer.steps=1", "trainer.eval_at_start=false", "trainer.export_hf=false"]
    run_inprocess(tmp_path, args)
    with pytest.raises(ConfigError, match="resume=true"):
        run_inprocess(tmp_path, args)
    state, rows = run_inprocess(tmp_path, [*args, "trainer.steps=2", "resume=true"])
    assert state.step == 2 and [r["step"] for r in rows] == [1, 2]


class _SignalOnFirstReward(TinyCharTask):
    """Sends SIGUSR1 to this very process from inside the first step."""

    sent = False

    def reward(self, problem, response_text):
        if not _SignalOnFirstReward.sent:
            _SignalOnFirstReward.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().reward(problem, response_text)


if "test_sigusr1" not in TASKS:
    TASKS.register("test_sigusr1")(_SignalOnFirstReward)


def test_sigusr1_checkpoints_after_the_current_step_in_process(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    state, rows = run_inprocess(
        tmp_path,
        [
            "task.name=test_sigusr1",
            "trainer.reward_workers=0",  # the reward signals the trainer itself
            "trainer.steps=5",
            "trainer.save_every=0",
            "trainer.eval_at_start=false",
        ],
    )
    assert state.extra.get("interrupted") and state.step == 1 and len(rows) == 1
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_000001"
    assert not (tmp_path / "hf_export").exists()  # no export for an unfinished run
    assert signal.getsignal(signal.SIGUSR1) == before  # handlers restored
    state, rows = run_inprocess(
        tmp_path,
        [
            "task.name=tiny",
            "trainer.steps=5",
            "trainer.save_every=0",
            "trainer.eval_at_start=false",
            "resume=true",
            "trainer.allow_config_change=true",
        ],
    )  # the signalling task is gone
    assert state.step == 5 and [r["step"] for r in rows] == [1, 2, 3, 4, 5]
