"""Issue 32, "Lost": a fresh run writes only into a new or empty folder, or one that is
plainly an earlier run of the same experiment; a folder holding a user's files (their own
config.yaml, or the project's conf/) is refused before Hydra or the run writes anything."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from nemo_d3s.config import ConfigError

from .conftest import FAST, cli_env, run_inprocess
from _limits import WAIT_S  # noqa: E402


def _cli(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", "experiment=smoke", *FAST, *args],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def test_output_dir_holding_a_users_files_is_refused_before_anything_is_written(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("lr: 0.1\nbatch: 8\n")  # a user's own config
    (mine / "notes.txt").write_text("keep")
    conf = tmp_path / "conf"  # what output_dir=conf pointed at: the project's config folder
    (conf / "model").mkdir(parents=True)
    (conf / "config.yaml").write_text("defaults:\n  - model: tiny\n")
    for folder, names in ((mine, "config.yaml (not a run's config), notes.txt"), (conf, "model")):
        before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        r = _cli(tmp_path, f"output_dir={folder}")
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.startswith("error: output_dir=") and r.stderr.count("\n") == 1, r.stderr
        assert names in r.stderr and "choose another output_dir" in r.stderr
        after = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        assert after == before and not (folder / ".hydra").exists()


def test_a_lone_user_config_yaml_is_not_taken_for_an_earlier_run(tmp_path):
    (tmp_path / "config.yaml").write_text("my: settings\n")
    with pytest.raises(ConfigError, match=r"not a run's config"):
        run_inprocess(tmp_path)
    assert (tmp_path / "config.yaml").read_text() == "my: settings\n"


def test_a_fresh_run_reuses_an_earlier_start_of_the_same_experiment_only(tmp_path):
    """A start that wrote only its config.yaml (killed before any record): the same
    experiment starts again there; another one (other seed) is refused, config kept."""
    run_inprocess(tmp_path, ["trainer.steps=1"])
    for name in ("metrics.jsonl", "eval.jsonl", "summary.json"):
        (tmp_path / name).unlink()
    for name in ("hf_export", "checkpoints"):
        shutil.rmtree(tmp_path / name, ignore_errors=True)
    original = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"config.yaml of another experiment \(seed: 0 -> 5"):
        run_inprocess(tmp_path, ["trainer.steps=1", "seed=5"])
    assert (tmp_path / "config.yaml").read_text() == original
    state, rows = run_inprocess(tmp_path, ["trainer.steps=2"])  # trainer.steps is resume-safe
    assert state.step == 2 and len(rows) == 2


@pytest.mark.parametrize(
    "change, listed",
    [
        (["task=basic_arithmetic"], "task.name: 'tiny' -> 'basic_arithmetic'"),
        (["+model.params.attn_implementation=eager"], "model.params.attn_implementation: "),
    ],
)
def test_resume_with_another_task_or_a_plus_key_is_a_changed_experiment(tmp_path, change, listed):
    """Issue 32: the keys the new task (or a "+" override) brings were counted as missing
    from config.yaml, which was blamed as "emptied, cut short or written by another
    version"."""
    run_inprocess(tmp_path, ["trainer.steps=1"])
    with pytest.raises(ConfigError, match="changes the experiment") as e:
        run_inprocess(tmp_path, ["trainer.steps=1", "resume=true", *change])
    assert listed in str(e.value) and "cut short" not in str(e.value)
