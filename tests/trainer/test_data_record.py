"""Issue 32: the data file edited between a run and its ``resume=true`` trained on other
data without a word. The run records what it read (path, size, SHA-256) in
``data_files.json``; a resume on changed data is refused before anything is touched."""

from __future__ import annotations

import json
import shutil

import pytest

from nemo_d3s.config import ConfigError

from .conftest import FAST, REPO, run_inprocess


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
