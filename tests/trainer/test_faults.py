"""Issue 9: the faults a new user met, one regression test each (see docs/faults.md).

Every run here is the smoke experiment in-process (seconds); the few that must go through
the real command line (Hydra acts before our code) run it in a subprocess.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_d3s.config import ConfigError
from nemo_d3s.files import apply_umask, current_umask, write_checksums
from nemo_d3s.tasks.base import TASKS
from nemo_d3s.tasks.tiny import TinyCharTask
from nemo_d3s.train import _is_collective_timeout, run_cli
from nemo_d3s.trainer import metrics as metrics_mod
from nemo_d3s.trainer.run_start import folder as rundir_mod
from nemo_d3s.trainer.checkpoint import CHECKSUMS, RUN_RECORD, checkpoint_dirs, verify_checkpoint
from nemo_d3s.trainer.faults import RunError
from nemo_d3s.trainer.loop import Trainer
from nemo_d3s.trainer.metrics import JsonlAppender, MetricsLogger, read_jsonl, truncate_jsonl
from nemo_d3s.trainer.run_start.folder import RunDirLock

from . import _tasks  # noqa: F401  (registers the misbehaving test tasks)
from .conftest import FAST, REPO, cli_env, compose, run_inprocess, without_timing
from _limits import WAIT_S  # noqa: E402

IN_PROCESS = "trainer.reward_workers=0"

# Three steps, a checkpoint after each, all kept: a resume can fall back two steps.
STEPS3 = [*FAST, "trainer.steps=3", "trainer.save_every=1", "trainer.keep_last=3"]


# ------------------------------------------------------------------ test tasks
# Tasks whose rewards signal the trainer itself: they run with trainer.reward_workers=0
# (IN_PROCESS), as a reward in a worker process signals only its worker.
class _SignalDuringEval(TinyCharTask):
    """Sends ``signum`` to this process at the first reward of the first evaluation."""

    signum = signal.SIGTERM
    sent = False

    def reward(self, problem, response_text):
        if problem.meta.get("split") == "eval" and not type(self).sent:
            type(self).sent = True
            os.kill(os.getpid(), self.signum)
        return super().reward(problem, response_text)


class _SigintOnce(TinyCharTask):
    sent = 0
    times = 1

    def reward(self, problem, response_text):
        if type(self).sent < type(self).times:
            type(self).sent += 1
            os.kill(os.getpid(), signal.SIGINT)
        return super().reward(problem, response_text)


class _SigintTwice(_SigintOnce):
    times = 2


for _name, _cls in (
    ("fault_signal_eval", _SignalDuringEval),
    ("fault_sigint_once", _SigintOnce),
    ("fault_sigint_twice", _SigintTwice),
):
    if _name not in TASKS:
        TASKS.register(_name)(_cls)


def _cli_code(capsys, overrides):
    """run_cli (what `python -m nemo_d3s.train` runs after Hydra) -> (exit code, stderr)."""
    code = run_cli(compose(["experiment=smoke", *overrides]))
    return code, capsys.readouterr().err


def _snapshot(d: Path) -> dict:
    """Every file under d (but the lock and Hydra's log) -> bytes."""
    return {
        str(p.relative_to(d)): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in (".nemo_d3s.lock", "train.log")
    }


# ------------------------------------------------------------------ security
class _Payload:
    """Unpickling this creates a marker file: the stand-in for os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize(
    "target", ["backend.pt", pytest.param("rng_rank0.pt", marks=pytest.mark.slow)]
)
def test_pickle_payload_in_checkpoint_is_refused_and_not_run(tmp_path, target, caplog):
    run_dir, marker = tmp_path / "run", tmp_path / "PWNED"
    _, rows = run_inprocess(run_dir, STEPS3)
    ckpt = run_dir / "checkpoints" / "step_000003"
    with (ckpt / target).open("wb") as f:
        pickle.dump({"state": _Payload(marker)}, f)
    # (a) stale checksums: the file is corrupt for the loader, which falls back to step 2
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        state, rows2 = run_inprocess(run_dir, [*STEPS3, "resume=true"])
    assert not marker.exists()
    assert f"{target} has" in caplog.text or f"{target} does not match" in caplog.text
    assert state.step == 3 and without_timing(rows2) == without_timing(rows)
    # (b) a payload whose checksums were rewritten to match: refused by weights_only=True
    with (ckpt / target).open("wb") as f:
        pickle.dump({"state": _Payload(marker)}, f)
    _rewrite_checksums(ckpt)
    with pytest.raises(RunError, match="refusing to load"):
        run_inprocess(run_dir, [*STEPS3, "resume=true"])
    assert not marker.exists()


def _rewrite_checksums(ckpt: Path) -> None:
    from nemo_d3s.files import write_checksums

    (ckpt / CHECKSUMS).unlink()
    write_checksums(ckpt)


def test_rng_state_is_stored_without_pickled_objects(tmp_path):
    run_inprocess(tmp_path, [*FAST, "trainer.steps=1"])
    ckpt = checkpoint_dirs(tmp_path / "checkpoints")[0]
    for f in ("rng_rank0.pt", "backend.pt"):
        torch.load(ckpt / f, weights_only=True)  # raises on anything but tensors and containers


def test_export_files_follow_the_umask(tmp_path):
    run_inprocess(tmp_path, [*FAST, "trainer.steps=1", "trainer.export_hf=true"])
    want = 0o666 & ~current_umask()
    files = [p for p in (tmp_path / "hf_export").iterdir() if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == want, p.name
    # the helper the GGUF conversion uses too
    f = tmp_path / "secret"
    f.write_text("x")
    os.chmod(f, 0o600)
    apply_umask(tmp_path)
    assert stat.S_IMODE(f.stat().st_mode) == want


# ------------------------------------------------------------------ data loss
def test_second_run_in_a_locked_directory_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with RunDirLock(run_dir):  # "the first run" holds the directory
        code, err = _cli_code(capsys, [*FAST, f"output_dir={run_dir}"])
        assert code == 2 and "is in use by another run" in err and f"pid {os.getpid()}" in err
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists()
    state, _ = run_inprocess(run_dir, FAST)  # released: the directory is free again
    assert state.step == 2


def test_lock_is_released_when_its_holder_is_killed(tmp_path):
    code = (
        "import sys, time; from nemo_d3s.trainer.run_start.folder import RunDirLock; "
        f"RunDirLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(RunError, match="in use"):
        RunDirLock(tmp_path).acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    RunDirLock(tmp_path).acquire().release()


def test_fresh_run_refuses_records_without_checkpoints_and_resume_moves_them_aside(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (run_dir / "eval.jsonl").write_text('{"step": 1, "eval_reward_mean": 0.5}\n')
    (run_dir / "summary.json").write_text("{}")
    (run_dir / "hf_export").mkdir()
    (run_dir / "hf_export" / "config.json").write_text("{}")
    (run_dir / "train.log").write_text("the earlier run's line\n")
    (run_dir / "train.rank1.log").write_text("the earlier run's warning\n")
    before = _snapshot(run_dir)
    with pytest.raises(ConfigError, match="earlier run's records"):
        run_inprocess(run_dir, FAST)
    assert _snapshot(run_dir) == before  # nothing touched
    state, rows = run_inprocess(run_dir, [*FAST, "resume=true"])
    assert state.step == 2 and [r["step"] for r in rows] == [1, 2]
    old = run_dir / "previous-1"
    assert (old / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    assert (old / "hf_export" / "config.json").is_file() and (old / "summary.json").is_file()
    # the logs go with them: the new run's train.log starts empty of the earlier run's lines
    assert (old / "train.log").read_text() == "the earlier run's line\n"
    assert (old / "train.rank1.log").is_file() and not (run_dir / "train.rank1.log").exists()
    assert "the earlier run's line" not in (run_dir / "train.log").read_text()


def test_garbled_metrics_line_keeps_the_later_rows(tmp_path, caplog):
    run_dir = tmp_path / "run"
    _, rows = run_inprocess(run_dir, STEPS3)
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2] + "\x00garbage"  # row of step 2
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        assert [r["step"] for r in read_jsonl(path)] == [1, 3]
    assert "line 2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        truncate_jsonl(path, 3)  # what resume does
    assert [r["step"] for r in read_jsonl(path)] == [1, 3] and "line 2" in caplog.text
    assert "garbage" in (run_dir / "metrics.jsonl.garbled").read_text()
    # a resumed run keeps rows 1 and 3 and appends after them
    state, rows2 = run_inprocess(run_dir, [*STEPS3, "trainer.steps=4", "resume=true"])
    assert [r["step"] for r in rows2] == [1, 3, 4]


def test_disk_full_during_a_metrics_write_leaves_only_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    w = JsonlAppender(path)
    w.write(json.dumps({"step": 1}))
    real = os.write

    def half_then_enospc(fd, data):
        real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_mod, "_write", half_then_enospc)
    with pytest.raises(RunError, match="metrics.jsonl.*No space left"):
        w.write(json.dumps({"step": 2, "reward_mean": 0.25}))
    monkeypatch.setattr(metrics_mod, "_write", real)
    w.write(json.dumps({"step": 2}))
    w.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 1}, {"step": 2}]
    # a partial last line left by an older writer is cut (kept in .garbled) when opened
    with path.open("a") as f:
        f.write('{"step": 3, "rew')
    JsonlAppender(path).close()
    assert path.read_text().endswith("\n") and len(read_jsonl(path)) == 2
    assert '{"step": 3, "rew' in (tmp_path / "metrics.jsonl.garbled").read_text()


# ------------------------------------------------------------------ checksums and fallback
def _flip_a_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


_CORRUPTIONS = {
    "bit_flip": (lambda c: _flip_a_byte(c / "backend.pt"), "does not match its SHA-256"),
    "truncated": (
        lambda c: (c / "rng_rank0.pt").write_bytes((c / "rng_rank0.pt").read_bytes()[:100]),
        "truncated",
    ),
    "empty": (lambda c: [p.unlink() for p in list(c.iterdir())], "empty or incomplete"),
    "garbled_state": (
        lambda c: (c / "trainer_state.json").write_text('{"step": 3, "upd'),
        "trainer_state.json is garbled",
    ),
}


# each corruption is a whole run (~11 s): the checksum's two failures every run, the other two
# in the slow tier (CI's budget, docs/ci.md)
@pytest.mark.parametrize(
    "kind",
    [
        k if k in ("bit_flip", "truncated") else pytest.param(k, marks=pytest.mark.slow)
        for k in sorted(_CORRUPTIONS)
    ],
)
def test_corrupt_latest_checkpoint_falls_back_to_the_newest_good_one(tmp_path, kind, caplog):
    run_dir = tmp_path / "run"
    _, rows = run_inprocess(run_dir, STEPS3)
    evals = read_jsonl(run_dir / "eval.jsonl")
    corrupt, why = _CORRUPTIONS[kind]
    ckpt = run_dir / "checkpoints" / "step_000003"
    corrupt(ckpt)
    assert verify_checkpoint(ckpt) is not None
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        state, rows2 = run_inprocess(run_dir, [*STEPS3, "resume=true"])
    assert "step_000003" in caplog.text and why in caplog.text
    assert "resuming from step_000002" in caplog.text
    assert state.step == 3 and without_timing(rows2) == without_timing(
        rows
    )  # step 3 run again, identically
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(evals)


def test_no_usable_checkpoint_is_a_clear_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_inprocess(run_dir, STEPS3)
    for c in checkpoint_dirs(run_dir / "checkpoints"):
        _flip_a_byte(c / "backend.pt")
    before = _snapshot(run_dir)
    code, err = _cli_code(capsys, [*STEPS3, f"output_dir={run_dir}", "resume=true"])
    assert (
        code == 2
        and err.startswith("error: no usable checkpoint")
        and len(err.strip().splitlines()) == 1
    )
    assert "step_000001" in err and "Traceback" not in err
    assert _snapshot(run_dir) == before


# ------------------------------------------------------------------ clear errors
def test_output_dir_that_is_a_file_or_empty_is_an_error_line_before_hydra_writes(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("keep me")
    for value, expect in ((str(target), "is a file"), ("", "must name a directory")):
        r = subprocess.run(
            [sys.executable, "-m", "nemo_d3s.train", "experiment=smoke", f"output_dir={value}"],
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
        )
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.startswith("error: ") and expect in r.stderr and "Traceback" not in r.stderr
    assert target.read_text() == "keep me"
    assert not (tmp_path / ".hydra").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("exists", [False, True])
def test_no_room_for_data_is_an_error_line_before_hydra_writes(tmp_path, exists):
    """A full disk: the start's probe created an empty file (which needs no data block), so
    Hydra's .hydra/ write was the first to fail, as a traceback. The probe writes real bytes
    now; a file-size limit of 1 KiB stands in for the full disk (the same failed write)."""
    out = tmp_path / "run"
    if exists:
        out.mkdir()
    script = tmp_path / "limited.py"
    script.write_text(
        "import resource, signal, sys\n"
        "if __name__ == '__main__':\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
        "    from nemo_d3s.train import main\n"
        "    sys.argv[0] = 'nemo-d3s-train'\n"
        "    main()\n"
    )
    r = subprocess.run(
        [sys.executable, str(script), "experiment=smoke", f"output_dir={out}"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: output_dir='{out}' "), lines
    assert "File too large" in lines[0] and "file-size limit (ulimit -f) is 1024 bytes" in lines[0]
    assert not (out / ".hydra").exists() and not (tmp_path / ".hydra").exists()


def test_unwritable_output_dir_is_an_error_line(tmp_path, capsys, monkeypatch):
    def read_only(p):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rundir_mod, "_probe_write", read_only)
    code, err = _cli_code(capsys, [*FAST, f"output_dir={tmp_path / 'ro'}"])
    assert (
        code == 2
        and "is not writable: Read-only file system" in err
        and str(tmp_path / "ro") in err
    )


def test_disk_full_during_a_checkpoint_is_an_error_line_and_keeps_the_last_one(
    tmp_path, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    run_inprocess(run_dir, [*FAST, "trainer.save_every=1"])
    before = _snapshot(run_dir / "checkpoints")
    import nemo_d3s.trainer.checkpoint as ck

    real_save = ck.torch.save

    def full(obj, f, *a, **k):  # what torch says when the disk fills during a save
        if str(f).endswith("backend.pt"):
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . unexpected pos 1210176 vs 1210064"
            )
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ck.torch, "save", full)
    code, err = _cli_code(
        capsys,
        [*FAST, "trainer.save_every=1", "trainer.steps=4", f"output_dir={run_dir}", "resume=true"],
    )
    assert code == 2 and "could not write checkpoint step_000003" in err and "unexpected pos" in err
    assert len(err.strip().splitlines()) == 1
    assert _snapshot(run_dir / "checkpoints") == before  # no temp dir left, step 2 untouched
    assert verify_checkpoint(run_dir / "checkpoints" / "step_000002") is None


def test_resume_with_a_different_model_shape_is_one_error_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_inprocess(run_dir, [*FAST, "trainer.steps=1"])
    bigger = "model.params.tiny.hidden_size=32"
    code, err = _cli_code(capsys, [*FAST, f"output_dir={run_dir}", "resume=true", bigger])
    assert (
        code == 2 and "model.params.tiny.hidden_size: 64 -> 32" in err
    )  # refused as a changed experiment
    code, err = _cli_code(
        capsys,
        [*FAST, f"output_dir={run_dir}", "resume=true", bigger, "trainer.allow_config_change=true"],
    )
    assert (
        code == 2
        and "was written for a different model" in err
        and "tensors differ in shape" in err
    )
    assert len(err.strip().splitlines()) == 1


def _without_run_record(run_dir):
    """The run's checkpoints as an earlier version wrote them: no run_record.json."""
    for ck in checkpoint_dirs(run_dir / "checkpoints"):
        (ck / RUN_RECORD).unlink()
        write_checksums(ck)


def test_garbled_config_yaml_on_resume_is_an_error_line_and_nothing_is_touched(
    tmp_path, capsys, caplog
):
    """With checkpoints of an earlier version (no config of their own) the garbled file is
    refused; a checkpoint's run record stands in for it (a warning names the file)."""
    run_dir = tmp_path / "run"
    run_inprocess(run_dir, [*FAST, "trainer.steps=1"])
    (run_dir / "config.yaml").write_text("seed: [0\ntrainer: {steps: \x07")
    saved = tmp_path / "saved"
    shutil.copytree(run_dir, saved)
    _without_run_record(run_dir)
    before = _snapshot(run_dir)
    code, err = _cli_code(capsys, [*FAST, f"output_dir={run_dir}", "resume=true"])
    assert code == 2 and "config.yaml" in err and "cannot be read" in err
    assert _snapshot(run_dir) == before
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        state, _ = run_inprocess(saved, [*FAST, "trainer.steps=2", "resume=true"])
    assert state.step == 2 and "config.yaml cannot be read" in caplog.text


@pytest.mark.parametrize("cut", ["emptied", pytest.param("cut_short", marks=pytest.mark.slow)])
def test_config_yaml_emptied_or_cut_short_on_resume_is_refused_like_an_unreadable_one(
    tmp_path, capsys, caplog, cut
):
    """Only the keys the old file still holds used to be compared: a changed seed went through.
    With the checkpoint's own config it is compared against that; without one (an earlier
    version's checkpoint) the file is reported as cut short."""
    run_dir = tmp_path / "run"
    run_inprocess(run_dir, [*FAST, "trainer.steps=1"])
    text = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(
        "" if cut == "emptied" else text[: text.index("\nseed:")] + "\n"
    )
    argv = [*FAST, f"output_dir={run_dir}", "resume=true", "trainer.steps=2", "seed=7"]
    before = _snapshot(run_dir)
    code, err = _cli_code(capsys, argv)
    assert code == 2 and "changes the experiment (seed: 0 -> 7)" in err and RUN_RECORD in err
    _without_run_record(run_dir)
    before = _snapshot(run_dir)
    code, err = _cli_code(capsys, argv)
    assert code == 2 and "config.yaml' lacks" in err and "emptied, cut short" in err, err
    assert "seed" in err or "..." in err
    assert _snapshot(run_dir) == before
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        state, _ = run_inprocess(
            run_dir, [*FAST, "resume=true", "trainer.steps=2", "trainer.allow_config_change=true"]
        )
    assert state.step == 2 and "lacks" in caplog.text


@pytest.mark.parametrize("case", ["folder", "missing", "not_utf8"])
def test_bad_dataset_path_is_one_error_line_naming_it(tmp_path, capsys, case):
    data = tmp_path / "train.jsonl"
    if case == "folder":
        data = tmp_path / "data"
        data.mkdir()
        override, expect = [f"task.params.train_path={data}"], "is a directory"
    elif case == "missing":
        override, expect = [], "task.params.train_path: required"
    else:
        data.write_bytes(
            b'{"question": "1+1?", "answer": "2"}\n{"question": "caf\xe9?", "answer": "3"}\n'
        )
        override, expect = [f"task.params.train_path={data}"], "line 2 is not UTF-8"
    code, err = _cli_code(
        capsys, ["task=jsonl_math", "task.eval_size=1", f"output_dir={tmp_path / 'out'}", *override]
    )
    assert code == 2 and expect in err and "Traceback" not in err, err
    if case != "missing":
        assert str(data) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_resume_refuses_a_changed_experiment_and_keeps_the_original_config(tmp_path):
    run_dir = tmp_path / "run"
    run_inprocess(run_dir, [*FAST, "trainer.steps=1"])
    original = (run_dir / "config.yaml").read_text()
    before = _snapshot(run_dir)
    for change, key in (("seed=1", "seed: 0 -> 1"), ("d3s=d1s", "d3s.preset: 'd3s' -> 'd1s'")):
        with pytest.raises(ConfigError, match="changes the experiment") as e:
            run_inprocess(run_dir, [*FAST, "resume=true", change])
        assert key in str(e.value)
        assert _snapshot(run_dir) == before
    state, _ = run_inprocess(
        run_dir, [*FAST, "resume=true", "seed=1", "trainer.allow_config_change=true"]
    )
    assert state.step == 2
    assert (run_dir / "config.yaml").read_text() == original
    assert "seed: 1" in (run_dir / "config.resumed-1.yaml").read_text()
    # a further segment with another length is recorded beside the original too
    state, _ = run_inprocess(
        run_dir,
        [*FAST, "resume=true", "seed=1", "trainer.allow_config_change=true", "trainer.steps=3"],
    )
    assert state.step == 3 and (run_dir / "config.resumed-2.yaml").is_file()


# ------------------------------------------------------------------ silent wrong results
def _math_file(tmp_path: Path, question_lengths) -> Path:
    data = tmp_path / "train.jsonl"
    rows = [{"question": ("7+" * (n // 2))[:n] or "1+1", "answer": "2"} for n in question_lengths]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_prompt_longer_than_the_context_is_caught_at_load(tmp_path, caplog):
    # tiny model: 1,024 positions, byte-level tokens; line 3 is 3,000 characters, line 5 200k
    data = _math_file(tmp_path, [10, 12, 3000, 14, 200_000, 16, 18, 20, 22, 24])
    task = ["task=jsonl_math", f"task.params.train_path={data}", "task.eval_size=2"]
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path / 'out'}", *FAST, *task])
    with pytest.raises(ConfigError, match=r"2 prompt\(s\) are longer than 1016 tokens") as e:
        Trainer(cfg).run()
    assert "line 3: prompt of" in str(e.value) or "line 5: prompt of 200,0" in str(e.value)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        state, rows = run_inprocess(tmp_path / "out", [*FAST, *task, "task.long_prompts=skip"])
    assert state.step == 2 and "skipped (task.long_prompts=skip)" in caplog.text


def test_rewards_outside_the_task_range_are_warned_once_and_counted(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        run_inprocess(tmp_path, [*FAST, "task.name=fault_huge_reward"])
    assert caplog.text.count("outside the task's declared range") == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reward_out_of_range_total"] > 1


def test_the_same_reward_for_every_rollout_for_many_steps_is_warned_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        state, rows = run_inprocess(
            tmp_path,
            [*FAST, "trainer.steps=7", "task.name=fault_zero_reward", "trainer.max_new_tokens=4"],
        )
    assert state.step == 7 and all(r["skipped"] == 1 for r in rows)
    assert caplog.text.count("every rollout of the last") == 1
    assert (
        "last 5 steps (steps 1-5) got reward 0.0" in caplog.text
        and "nothing is learned" in caplog.text
    )


def test_dataset_rows_the_verifier_cannot_check_are_counted_in_the_summary(tmp_path, caplog):
    data = tmp_path / "train.jsonl"
    answers = ["3", "seventy-two", "5", "yes", "7", "8", "9", "10"]
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {i}?", "answer": a}) + "\n"
            for i, a in enumerate(answers)
        )
    )
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.tasks"):
        run_inprocess(
            tmp_path / "run",
            [
                *FAST,
                "trainer.steps=1",
                "task=jsonl_math",
                f"task.params.train_path={data}",
                "task.eval_size=2",
                "trainer.prompts_per_step=2",
                "trainer.max_new_tokens=4",
            ],
        )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["unusable_references"] == 2
    assert "2 of 8 reference answers" in caplog.text


def test_verifier_failing_on_every_call_stops_the_run(tmp_path, capsys):
    code, err = _cli_code(
        capsys,
        [
            *FAST,
            "trainer.steps=10",
            "task.name=fault_broken_verifier",
            "trainer.max_failed_reward_steps=3",
            f"output_dir={tmp_path}",
        ],
    )
    assert code == 2 and "failed on every call in 3 consecutive steps" in err
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_eval_size_beyond_the_limit_is_refused(tmp_path):
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "task.eval_size=100000"])
    with pytest.raises(ConfigError, match="task.eval_size=100000: exceeds task.max_eval_size"):
        Trainer(cfg)


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_stop_signal_is_honoured_inside_an_evaluation(tmp_path):
    args = [
        *FAST,
        "trainer.steps=2",
        "task.eval_size=8",
        "trainer.eval_batch_size=1",
        "trainer.eval_every=1",
    ]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref_dir, [*args, "task.name=tiny"])
    _SignalDuringEval.sent = False
    state, rows = run_inprocess(run_dir, [*args, "task.name=fault_signal_eval", IN_PROCESS])
    assert state.extra.get("interrupted") and state.step == 1
    assert read_jsonl(run_dir / "eval.jsonl") == []  # the evaluation was abandoned within a batch
    ckpt = json.loads((run_dir / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert ckpt["extra"]["pending_eval"] == 1
    state, rows = run_inprocess(
        run_dir, [*args, "task.name=tiny", "resume=true", "trainer.allow_config_change=true"]
    )
    assert state.step == 2
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(
        read_jsonl(ref_dir / "eval.jsonl")
    )
    assert without_timing(rows) == without_timing(read_jsonl(ref_dir / "metrics.jsonl"))


def _first_run_step_fails(monkeypatch, exc):
    """The loop's first ``run_step`` call of the next run raises ``exc(step)``."""
    from nemo_d3s.trainer import loop as loop_mod

    real, calls = loop_mod.run_step, []

    def failing(ctx, step, progress):
        if not calls:
            calls.append(step)
            raise exc(step)
        return real(ctx, step, progress)

    monkeypatch.setattr(loop_mod, "run_step", failing)
    return lambda: monkeypatch.setattr(loop_mod, "run_step", real)


def test_a_stop_in_the_first_step_does_not_evaluate_step_0_twice_on_resume(tmp_path, monkeypatch):
    """The start-of-run evaluation wrote its row, then a stop in step 1's generation saved
    step_000000: the resume ran the start-of-run evaluation again, a second step-0 row."""
    from nemo_d3s.trainer.step import StepInterrupted

    args = [*FAST, "trainer.eval_at_start=true", "trainer.eval_every=2"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref_dir, args)
    restore = _first_run_step_fails(monkeypatch, StepInterrupted)
    state, _ = run_inprocess(run_dir, args)
    assert state.extra.get("interrupted") and state.step == 0
    assert checkpoint_dirs(run_dir / "checkpoints")[0].name == "step_000000"
    restore()
    run_inprocess(run_dir, [*args, "resume=true"])
    assert [e["step"] for e in read_jsonl(run_dir / "eval.jsonl")] == [0, 2]
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(
        read_jsonl(ref_dir / "eval.jsonl")
    )


def test_a_crash_after_a_resumed_evaluation_does_not_leave_its_row_twice(tmp_path, monkeypatch):
    """A checkpoint with a pending evaluation, resumed: the evaluation ran and wrote its row,
    then the run crashed before its next checkpoint. The next resume evaluates that step
    again; its earlier row must go, not stay beside the new one."""
    args = [*FAST, "trainer.steps=2", "task.eval_size=8", "trainer.eval_every=1"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref_dir, [*args, "task.name=tiny"])
    _SignalDuringEval.sent = False
    run_inprocess(run_dir, [*args, "task.name=fault_signal_eval", IN_PROCESS])
    resume = [*args, "task.name=tiny", "resume=true", "trainer.allow_config_change=true"]
    restore = _first_run_step_fails(monkeypatch, RuntimeError)
    with pytest.raises(RuntimeError):
        run_inprocess(run_dir, resume)
    assert [e["step"] for e in read_jsonl(run_dir / "eval.jsonl")] == [1]  # written, then a crash
    restore()
    state, _ = run_inprocess(run_dir, resume)
    assert state.step == 2
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(
        read_jsonl(ref_dir / "eval.jsonl")
    )


@pytest.mark.parametrize("k", [0, 1])
def test_a_stop_during_the_resumed_pending_evaluation_keeps_the_checkpoint_as_it_was(tmp_path, k):
    """The resume's pending evaluation stopped again: the checkpoint it came from is still
    the run's state and stays untouched. It used to be saved again from a pipeline not
    started yet: at k = 1 without the batch generated ahead, so the next resume generated it
    with newer weights than an uninterrupted run's."""
    args = [*FAST, "trainer.steps=3", "task.eval_size=8", "trainer.eval_every=1"]
    args += [f"rollout.max_staleness={k}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref_dir, [*args, "task.name=tiny"])
    _SignalDuringEval.sent = False
    run_inprocess(run_dir, [*args, "task.name=fault_signal_eval", IN_PROCESS])
    ckpt = checkpoint_dirs(run_dir / "checkpoints")[0]
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    if k:
        assert any(n.startswith("rollouts_rank") for n in before)
    _SignalDuringEval.sent = False
    resume = ["resume=true", "trainer.allow_config_change=true"]
    state, _ = run_inprocess(run_dir, [*args, "task.name=fault_signal_eval", IN_PROCESS, *resume])
    assert state.extra.get("interrupted") and state.step == ckpt_step(ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert checkpoint_dirs(run_dir / "checkpoints") == [ckpt]
    state, rows = run_inprocess(run_dir, [*args, "task.name=tiny", *resume])
    assert state.step == 3
    assert without_timing(rows) == without_timing(read_jsonl(ref_dir / "metrics.jsonl"))
    assert without_timing(read_jsonl(run_dir / "eval.jsonl")) == without_timing(
        read_jsonl(ref_dir / "eval.jsonl")
    )


def test_a_stop_during_the_resumed_boundarys_refit_is_a_clean_stop(tmp_path, monkeypatch):
    """``GenerationPipeline.start`` refits the engine at a boundary a stop cut short (k > 0,
    weights kept); a second stop there raised out of the loop: a traceback, exit 1, no
    ``interrupted.json``. Now it stops as anywhere else, its checkpoint kept as it was."""
    from nemo_d3s.backends.base import GenerationInterrupted
    from nemo_d3s.trainer.pipeline import GenerationPipeline
    from nemo_d3s.trainer.step import StepInterrupted

    args = [*FAST, "trainer.steps=2", "trainer.save_every=1"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    _, ref_rows = run_inprocess(ref_dir, args)
    restore = _first_run_step_fails(monkeypatch, StepInterrupted)
    run_inprocess(run_dir, args)
    restore()
    ckpt = checkpoint_dirs(run_dir / "checkpoints")[0]
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    def stopped(self, *a, **kw):
        raise GenerationInterrupted("stop requested during the refit")

    with monkeypatch.context() as m:
        m.setattr(GenerationPipeline, "start", stopped)
        state, _ = run_inprocess(run_dir, [*args, "resume=true"])
    assert state.extra.get("interrupted") and state.step == 0
    assert json.loads((run_dir / "interrupted.json").read_text())["checkpoint"] == str(ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    state, rows = run_inprocess(run_dir, [*args, "resume=true"])
    assert state.step == 2 and without_timing(rows) == without_timing(ref_rows)


def test_a_stop_before_a_resumed_runs_first_update_keeps_its_checkpoint(tmp_path, monkeypatch):
    """A stop in the first step of a resumed run (or in its start-up: trainer/signals.py
    carries it to that step) saved the checkpoint it had just loaded again: a whole save of
    the same state inside a pre-emption's grace time."""
    from nemo_d3s.trainer.step import StepInterrupted

    args = [*FAST, "trainer.steps=2", "trainer.save_every=1"]
    run_dir = tmp_path / "run"
    restore = _first_run_step_fails(monkeypatch, StepInterrupted)
    run_inprocess(run_dir, args)
    restore()
    ckpt = checkpoint_dirs(run_dir / "checkpoints")[0]
    stamp = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    restore = _first_run_step_fails(monkeypatch, StepInterrupted)
    state, _ = run_inprocess(run_dir, [*args, "resume=true"])
    restore()
    assert state.extra.get("interrupted") and state.step == 0
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == stamp
    assert json.loads((run_dir / "interrupted.json").read_text())["checkpoint"] == str(ckpt)


def ckpt_step(ckpt: Path) -> int:
    return json.loads((ckpt / "trainer_state.json").read_text())["step"]


# ------------------------------------------------------------------ hang
def test_first_sigint_checkpoints_like_sigterm_second_stops_at_once(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    _SigintOnce.sent = 0
    state, rows = run_inprocess(
        tmp_path / "a", [*FAST, "trainer.steps=4", "task.name=fault_sigint_once", IN_PROCESS]
    )
    assert state.extra.get("interrupted") and state.step == 1 and len(rows) == 1
    assert (tmp_path / "a" / "checkpoints" / "step_000001").is_dir()
    assert signal.getsignal(signal.SIGINT) == before
    _SigintTwice.sent = 0
    with pytest.raises(SystemExit) as e:
        run_inprocess(
            tmp_path / "b", [*FAST, "trainer.steps=4", "task.name=fault_sigint_twice", IN_PROCESS]
        )
    assert e.value.code == 128 + signal.SIGINT
    assert checkpoint_dirs(tmp_path / "b" / "checkpoints") == []
    assert signal.getsignal(signal.SIGINT) == before


def test_a_second_sigint_after_the_checkpoint_keeps_the_interrupted_exit_code(
    tmp_path, monkeypatch, capsys
):
    """Issue 32: a second quick Ctrl-C that arrived once the loop had checkpointed and
    restored its handler (here: while the metrics file closes) was Python's ordinary
    KeyboardInterrupt: "exit code 75" printed, 130 returned. It is ignored now."""
    real_close = MetricsLogger.close

    def close_then_sigint(self):
        real_close(self)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(MetricsLogger, "close", close_then_sigint)
    code, err = _cli_exit_after_one_sigint(tmp_path, capsys)
    assert code == 75
    assert "exit code 75: interrupted" in err


def _cli_exit_after_one_sigint(tmp_path, capsys):
    """(exit code, stderr) of the CLI's run (train.py ``_run``) whose task sends one SIGINT,
    the signal handlers restored after it."""
    from nemo_d3s import train as train_mod

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _SigintOnce.sent = 0
    argv = ["experiment=smoke", *FAST, "trainer.steps=4", "task.name=fault_sigint_once"]
    cfg = compose([*argv, IN_PROCESS, f"output_dir={tmp_path}"])
    try:
        with pytest.raises(SystemExit) as e:
            train_mod._run(cfg)
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
    return e.value.code, capsys.readouterr().err


def test_a_second_sigint_once_the_stop_checkpoint_is_written_keeps_exit_code_75(
    tmp_path, monkeypatch, capsys
):
    """A second Ctrl-C while the run shut down after its stop checkpoint (the loop's handler
    still installed: here while interrupted.json is written) stopped it "without a
    checkpoint" with 130, although the checkpoint was there."""
    from nemo_d3s.trainer import records

    real = records.write_interrupted_marker

    def marker_then_sigint(out, marker):
        real(out, marker)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(records, "write_interrupted_marker", marker_then_sigint)
    code, err = _cli_exit_after_one_sigint(tmp_path, capsys)
    assert code == 75, err
    assert "SIGINT: already stopping; the checkpoint is written" in err
    assert "without a checkpoint" not in err


def test_process_group_timeout_is_configurable_and_reported(tmp_path):
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "trainer.dist_timeout_minutes=0"])
    with pytest.raises(ConfigError, match="trainer.dist_timeout_minutes"):
        Trainer(cfg)
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}"])
    assert cfg.trainer.dist_timeout_minutes == 30.0  # torch's and Megatron's default
    from nemo_d3s.trainer.build import backend_from_config

    assert backend_from_config(cfg).cfg.dist_timeout_minutes == 30.0  # reaches init_world
    assert _is_collective_timeout(
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
            "[127.0.0.1]:3456: Connection timed out waiting for recv"
        )
    )
    assert not _is_collective_timeout(RuntimeError("shape mismatch"))


# ------------------------------------------------------------------ newcomer output
def test_run_directory_is_printed_at_start_and_in_the_done_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="nemo_d3s.trainer"):
        run_inprocess(tmp_path, FAST)
    assert f"run directory: {tmp_path.resolve()}" in caplog.text
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done: ")]
    assert done and done[-1].endswith(f"run directory: {tmp_path.resolve()}")


def test_the_progress_bar_clock_stands_still_during_evaluations(tmp_path, monkeypatch):
    """Its s/step and ETA are about training steps: the main job's bar showed 167.9 s/step
    after the final evaluation for a 69 s step. A hand-driven clock stands in for time.time
    (the pause's) and for tqdm's own (``tqdm._time``)."""
    now = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "time", lambda: now[0])
    logger = MetricsLogger(
        str(tmp_path),
        enabled=True,
        tensorboard=False,
        progress_bar=True,
        total_steps=10,
        start_step=0,
    )
    logger.bar._time = lambda: now[0]
    logger.bar.start_t = logger.bar.last_print_t = now[0]
    with logger.clock_paused():  # the initial evaluation: 300 s
        now[0] += 300.0
    assert logger.bar.format_dict["elapsed"] == 0.0 and logger.bar.n == 0
    now[0] += 60.0  # a 60 s step
    logger.log_step({"step": 1, "time_step": 60.0})
    with logger.clock_paused():  # an evaluation after it: 100 s
        now[0] += 100.0
    now[0] += 60.0  # the next step
    logger.log_step({"step": 2, "time_step": 60.0})
    with logger.clock_paused():  # the final evaluation
        now[0] += 100.0
    fmt = logger.bar.format_dict
    assert fmt["elapsed"] == 120.0 and fmt["n"] == 2
    assert fmt["rate"] == pytest.approx(1 / 60.0)  # tqdm's smoothed rate: no pause in it
    logger.close()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_rank_makes_the_other_exit_after_the_timeout(tmp_path):
    """2 ranks; rank 1 SIGSTOPs itself after step 2 (stopped, not dead). Rank 0 must leave
    its collective after trainer.dist_timeout_minutes (here 6 s) with one error line and
    exit code 3, instead of waiting torch's default 30 minutes."""
    env = cli_env()
    env.update(
        NEMO_D3S_FAULT="loop.step_done@2=stop",
        NEMO_D3S_FAULT_RANK="1",
        NEMO_D3S_FAULT_PIDFILE=str(tmp_path / "stopped.pids"),
    )
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "nemo_d3s.train",
                "experiment=smoke",
                "trainer.steps=20",
                "trainer.dist_timeout_minutes=0.1",
                f"output_dir={tmp_path / 'run'}",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
    finally:  # never leave a stopped process behind
        for pid in (
            (tmp_path / "stopped.pids").read_text().split()
            if (tmp_path / "stopped.pids").exists()
            else []
        ):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = r.stdout + r.stderr
    assert (
        "error: a collective timed out after 0.1 minutes (trainer.dist_timeout_minutes)" in out
    ), out[-3000:]
    # (no clock in the verdict: the run ending inside WAIT_S, 20 minutes, is what tells it from
    # torch's default 30; a loaded machine only makes it slower)
    assert "exitcode  : 3" in out


def test_a_filesystem_without_locks_runs_with_a_warning(tmp_path, monkeypatch, caplog):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        state, _ = run_inprocess(tmp_path, FAST)
    assert state.step == 2 and "has no file locks" in caplog.text


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_on_one_rank_during_generation_stops_both_and_resumes_exactly(tmp_path):
    """2 ranks; only rank 1 gets SIGTERM, in the middle of decoding (fault point
    engine.decode). Both ranks agree right after generation, checkpoint the same step and
    exit 75 (no hang in the selector's collectives); resume=true ends with the metrics of an
    uninterrupted 2-rank run."""
    base = [
        "experiment=smoke",
        "trainer.steps=6",
        "trainer.save_every=3",
        "trainer.eval_every=0",
        "trainer.eval_at_start=false",
        "trainer.max_new_tokens=12",
    ]

    def torchrun(args, env):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "nemo_d3s.train",
                *base,
                *args,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )

    ref = torchrun([f"output_dir={tmp_path / 'ref'}"], cli_env())
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    env = cli_env()
    env.update(NEMO_D3S_FAULT="engine.decode@20=term", NEMO_D3S_FAULT_RANK="1")
    cut = torchrun([f"output_dir={tmp_path / 'run'}"], env)
    out = cut.stdout + cut.stderr
    # torchrun reports a rank's exit 75 (interrupted) as 1; the marker says what it was
    assert cut.returncode != 0 and (tmp_path / "run" / "interrupted.json").is_file(), out[-3000:]
    assert "exit code 75: interrupted" in out, out[-3000:]
    assert "received a stop signal on another rank" in out or "received SIGTERM" in out, out[-3000:]
    stopped_at = len(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert stopped_at < 6
    again = torchrun([f"output_dir={tmp_path / 'run'}", "resume=true"], cli_env())
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert without_timing(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == without_timing(
        read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    )


def test_a_refit_failed_elsewhere_names_how_many_ranks_failed(caplog):
    """agreed_refit: the rank whose refit failed raises its own error; the others say on how
    many ranks it failed (the step's agreement counts them) or "another rank" (a bool); a
    failure a stop signal explains is a warning, and the stop is returned."""
    from nemo_d3s.trainer.faults import agreed_refit

    def boom():
        raise ValueError("vLLM refused a tensor")

    with pytest.raises(ValueError, match="vLLM refused"):
        agreed_refit(boom, lambda failed: (False, 1 if failed else 0))
    with pytest.raises(RuntimeError, match=r"the refit failed on 2 rank\(s\)"):
        agreed_refit(lambda: None, lambda failed: (False, 2))
    with pytest.raises(RuntimeError, match="the refit failed on another rank"):
        agreed_refit(lambda: None, lambda failed: (False, True))
    assert agreed_refit(lambda: None, lambda failed: (False, 0)) is False
    with caplog.at_level(logging.WARNING):
        assert agreed_refit(boom, lambda failed: (True, 1)) is True
    assert "the refit stopped with the job (vLLM refused a tensor)" in caplog.text
