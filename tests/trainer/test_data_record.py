"""Issue 32: the data file edited between a run and its ``resume=true`` trained on other
data without a word. The run records what it read (path, size, SHA-256) in
``data_files.json``; a resume on changed data is refused before anything is touched."""

from __future__ import annotations

import json
import shutil

import pytest

from nemo_d3s.config import ConfigError

from .conftest import FAST, REPO, compose, run_inprocess


def _task(data):
    return [
        "task=jsonl_math",
        f"task.params.train_path={data}",
        "task.params.answer_format=plain",
        "task.params.reward_fn=examples/reward_last_number.py:score",
        "task.eval_size=4",
    ]


def test_resume_on_an_edited_data_file_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the reward_fn path is relative to the working directory
    data = tmp_path / "train.jsonl"
    shutil.copyfile(REPO / "examples" / "data" / "sums.jsonl", data)
    run_dir = tmp_path / "run"
    run_inprocess(run_dir, [*FAST, "trainer.steps=1", *_task(data)])
    rec = json.loads((run_dir / "data_files.json").read_text())["files"]
    assert rec["task.params.train_path"]["path"] == str(data.resolve())
    assert rec["task.params.train_path"]["size"] == data.stat().st_size
    assert rec["task.params.reward_fn"]["path"].endswith("examples/reward_last_number.py")

    def files():  # the lock file is rewritten by each start (its holder): not a record
        return {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.name[0] != "."}

    before = files()
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(reversed(lines)))  # same size, other order: only the hash tells
    with pytest.raises(ConfigError, match=r"task.params.train_path: .*train.jsonl' changed since"):
        run_inprocess(run_dir, [*FAST, "trainer.steps=2", "resume=true", *_task(data)])
    assert files() == before
    moved = tmp_path / "moved.jsonl"
    shutil.copyfile(data, moved)
    with pytest.raises(ConfigError, match=r"train.jsonl' -> '.*moved.jsonl'"):
        run_inprocess(run_dir, [*FAST, "trainer.steps=2", "resume=true", *_task(moved)])
    data.write_text("".join(lines))  # restored: the resume goes on
    state, _ = run_inprocess(run_dir, [*FAST, "trainer.steps=2", "resume=true", *_task(data)])
    assert state.step == 2


def _module_task(tmp_path, monkeypatch, body="def score(r, a):\n    return 1.0\n"):
    """task=jsonl_math with ``reward_fn=my_scores:score``, a module on the Python path."""
    pkg = tmp_path / "mods"
    pkg.mkdir(exist_ok=True)
    (pkg / "my_scores.py").write_text(body)
    monkeypatch.syspath_prepend(str(pkg))
    data = tmp_path / "train.jsonl"
    if not data.exists():
        shutil.copyfile(REPO / "examples" / "data" / "sums.jsonl", data)
    return [
        "task=jsonl_math",
        f"task.params.train_path={data}",
        "task.params.answer_format=plain",
        "task.params.reward_fn=my_scores:score",
        "task.eval_size=4",
    ]


def _folder(tmp_path, argv, record=True):
    """A run folder with one checkpoint (a run record when ``record``) and data_files.json."""
    from omegaconf import OmegaConf

    from nemo_d3s.files import write_checksums
    from nemo_d3s.trainer.checkpoint import RUN_RECORD
    from nemo_d3s.trainer.run_start.data_record import data_files, write_data_record
    from nemo_d3s.trainer.run_start.decision import run_record

    out = tmp_path / "run"
    cfg = compose(["experiment=smoke", *argv, f"output_dir={out}"])
    ck = out / "checkpoints" / "step_000001"
    ck.mkdir(parents=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    write_data_record(data_files(cfg), out)
    (ck / "trainer_state.json").write_text('{"step": 1}')
    if record:
        (ck / RUN_RECORD).write_text(json.dumps(run_record(cfg)))
    write_checksums(ck)
    return out


def _decide(out, argv):
    from nemo_d3s.trainer.run_start import decide

    return decide(compose(["experiment=smoke", *argv, f"output_dir={out}", "resume=true"]), out)


def test_a_reward_module_is_recorded_and_an_edit_refused(tmp_path, monkeypatch):
    """``reward_fn=module:function`` was not recorded: an edited module resumed silently."""
    argv = _module_task(tmp_path, monkeypatch)
    out = _folder(tmp_path, argv)
    rec = json.loads((out / "data_files.json").read_text())["files"]
    assert rec["task.params.reward_fn"]["path"] == str(tmp_path / "mods" / "my_scores.py")
    assert _decide(out, argv).kind == "resume"
    (tmp_path / "mods" / "my_scores.py").write_text("def score(r, a):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"task.params.reward_fn: .*my_scores.py' changed since"):
        _decide(out, argv)


def test_a_deleted_or_wrong_shaped_data_record_is_checked_against_the_checkpoint_or_refused(
    tmp_path, monkeypatch
):
    """data_files.json deleted: the resume checked nothing. The checkpoint's run record is
    checked instead; a checkpoint without one (an earlier version's) is refused like a missing
    checksums.json; a wrong-shaped file was a traceback."""
    argv = _module_task(tmp_path, monkeypatch)
    out = _folder(tmp_path, argv)
    (out / "data_files.json").unlink()
    assert _decide(out, argv).kind == "resume"
    (tmp_path / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"train.jsonl' changed since .*run_record.json"):
        _decide(out, argv)
    shutil.copyfile(REPO / "examples" / "data" / "sums.jsonl", tmp_path / "train.jsonl")
    shutil.rmtree(out)
    out = _folder(tmp_path, argv, record=False)
    (out / "data_files.json").unlink()
    with pytest.raises(ConfigError, match=r"data_files.json' is missing and the checkpoints carry"):
        _decide(out, argv)
    assert _decide(out, [*argv, "trainer.allow_config_change=true"]).kind == "resume"
    for text in ('{"files": {"task.params.train_path": "x"}}', "[]", '{"files": [1]}'):
        (out / "data_files.json").write_text(text)
        with pytest.raises(ConfigError, match=r"data_files.json' is garbled \(not"):
            _decide(out, argv)
