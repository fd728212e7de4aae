"""Issue 35: ``output_dir=X resume=true`` continues run X as it was started. The run's own
``config.yaml`` is the base; only what the current command line touches comes from it
(``trainer.resume_config``); the resume checks then refuse what changes the experiment.
A ``resume=true`` on a folder without a checkpoint says plainly that it starts afresh.
``trainer.save_every=0`` writes no checkpoint (a stop signal still does)."""

from __future__ import annotations

import logging
import shutil

import pytest
from omegaconf import OmegaConf

from nemo_d3s.config import ConfigError
from nemo_d3s.train import conf_dir
from nemo_d3s.trainer.checkpoint import checkpoint_dirs
from nemo_d3s.trainer.metrics import read_jsonl
from nemo_d3s.trainer.run_start.config_file import compare_config, diff_values
from nemo_d3s.trainer.run_start.config_merge import (
    agree_on_config,
    config_digest,
    merge_untouched,
    resolve_config,
    touched_keys,
)
from nemo_d3s.trainer.overrides import resume_deletions
from nemo_d3s.trainer.run_start.decision import trusted_run_config

from .conftest import FAST, PODS_SMOKE, cli, compose, run_inprocess, without_timing
from _limits import WAIT_S  # noqa: E402


def check_resume_config(cfg, folder):
    """The resume's config check as the start runs it: against the config the run trusts."""
    compare_config(cfg, *trusted_run_config(folder))


ORIGINAL = ["experiment=smoke", *PODS_SMOKE, "trainer.lr=0.5", "+model.params.extra=1"]


def _plain(cfg):
    return OmegaConf.to_container(cfg, resolve=True)


def _start(tmp_path, argv=ORIGINAL):
    """config.yaml of a run started with ``argv`` (what write_config writes), as a dict."""
    cfg = compose([*argv, f"output_dir={tmp_path}"])
    old = _plain(cfg)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    return old


def _resume(tmp_path, argv):
    """The resumed config as train.main builds it: ``~key`` deletions held back from Hydra."""
    argv = [f"output_dir={tmp_path}", "resume=true", *argv]
    hydra_argv, held = resume_deletions(argv, [p.name for p in conf_dir().iterdir() if p.is_dir()])
    cfg = compose(hydra_argv)
    OmegaConf.resolve(cfg)
    overrides = hydra_argv + held
    return _plain(resolve_config(cfg, overrides, tmp_path, lambda: compose([]), conf_dir()))


def _changes(old, new):
    return {k: (a, b) for k, a, b, _ in diff_values(old, new)}


def test_merge_untouched_hand_worked():
    old = {"a": 1, "b": {"x": 1, "y": 2, "p": {"k": 1}}, "c": 3}
    new = {"a": 9, "b": {"x": 8, "y": 7, "p": {"q": 2}}, "d": 4}
    # untouched: everything from old (b.p keeps k, loses q; d absent; c kept)
    assert merge_untouched(old, new, {"a", "b.y"}) == {
        "a": 9,
        "b": {"x": 1, "y": 7, "p": {"k": 1}},
        "c": 3,
    }
    # a touched subtree is new's whole (k gone); a touched key new lacks is dropped
    assert merge_untouched(old, new, {"b.p", "c"}) == {"a": 1, "b": {"x": 1, "y": 2, "p": {"q": 2}}}


def test_a_touched_key_covers_its_subtree_not_the_keys_it_is_a_string_prefix_of(tmp_path):
    """``trainer.lr`` touched: ``trainer.lr_schedule`` (whose name starts with it) is still the
    run's; a key path is compared part by part, not as a string prefix."""
    old = {"t": {"lr": 1, "lr_schedule": "cosine", "lr_x": {"y": 1}}}
    new = {"t": {"lr": 2, "lr_schedule": "constant", "lr_x": {"y": 2}}}
    assert merge_untouched(old, new, {"t.lr"}) == {
        "t": {"lr": 2, "lr_schedule": "cosine", "lr_x": {"y": 1}}
    }
    # nor is an untouched key below one whose name is a string prefix of a touched key
    assert merge_untouched({"t": {"lr": 1}}, {"t": {"lr": {"y": 2}}}, {"t.lr_x"}) == {
        "t": {"lr": 1}
    }
    # the whole path: a run started with a cosine schedule, resumed with another lr
    old = _start(tmp_path, ["experiment=smoke", "trainer.lr_schedule=cosine"])
    new = _resume(tmp_path, ["trainer.lr=0.002"])
    assert new["trainer"]["lr_schedule"] == "cosine"
    assert _changes(old, new) == {
        "resume": (False, True),
        "trainer.lr": (old["trainer"]["lr"], 0.002),
    }
    with pytest.raises(ConfigError, match=r"changes the experiment \(trainer\.lr:") as e:
        check_resume_config(OmegaConf.create(new), tmp_path)
    assert "lr_schedule" not in str(e.value)


def test_touched_keys_of_keys_groups_and_global_options():
    conf = conf_dir()
    t = touched_keys(
        ["trainer.steps=3", "~model.params.tiny", "d3s=d3s", "hydra.verbose=true"], conf
    )
    assert {"trainer.steps", "model.params.tiny", "d3s", "output_dir", "resume"} <= t
    assert not any(k.startswith("hydra") for k in t)
    smoke = touched_keys(["experiment=smoke"], conf)
    # the leaves conf/experiment/smoke.yaml sets, and the groups its defaults override
    assert {"model", "task", "trainer.steps", "d3s.min_kept_tokens", "model.name"} <= smoke
    assert "d3s" not in smoke and "d3s.preset" not in smoke and "seed" not in smoke


def test_resume_from_the_folder_alone_is_the_original_config(tmp_path):
    old = _start(tmp_path)
    new = _resume(tmp_path, ["trainer.steps=9"])
    assert _changes(old, new) == {"resume": (False, True), "trainer.steps": (4, 9)}
    # a full repeat of the original command line gives the original config too
    assert _changes(old, _resume(tmp_path, ORIGINAL)) == {"resume": (False, True)}


@pytest.mark.parametrize(
    "argv",
    [
        ["experiment=megatron_smoke", "d3s=d1s"],
        ["experiment=llama3_8b", "algorithm=gspo", "trainer.steps=7"],
        ["model=tiny", "task=countdown", "d3s=d3s_i", "seed=3"],
        ["experiment=smoke", "rollout=vllm", "~model.params.tiny", "+model.params.x=[1,2]"],
    ],
)
def test_the_folder_alone_or_the_full_command_both_give_the_original(tmp_path, argv):
    old = _start(tmp_path, argv)
    assert _changes(old, _resume(tmp_path, [])) == {"resume": (False, True)}
    assert _changes(old, _resume(tmp_path, argv)) == {"resume": (False, True)}


def test_an_explicit_default_still_counts_as_a_change(tmp_path):
    """``d3s=d3s`` (the default preset) and ``trainer.lr=<its default>`` differ from the
    run's values: the user chose them, they are not silently replaced by the run's."""
    old = _start(tmp_path)
    default_lr = compose([]).trainer.lr
    changed = _changes(old, _resume(tmp_path, ["d3s=d3s", f"trainer.lr={default_lr}"]))
    assert changed["d3s.preset"] == ("pods", "d3s") and changed["trainer.lr"] == (0.5, default_lr)
    assert not any(k.startswith(("model.", "task.")) for k in changed), changed
    with pytest.raises(ConfigError, match=r"changes the experiment \(d3s\.") as e:
        check_resume_config(OmegaConf.create(_resume(tmp_path, ["d3s=grpo"])), tmp_path)
    assert "d3s.preset: 'pods' -> 'grpo'" in str(e.value)
    assert "model." not in str(e.value) and "lacks" not in str(e.value)


@pytest.mark.parametrize("text", ["[1, 2]\n", "trainer: {steps: 3\n", ""])
def test_an_unreadable_config_yaml_leaves_the_composed_config(tmp_path, text):
    (tmp_path / "config.yaml").write_text(text)
    argv = [f"output_dir={tmp_path}", "resume=true", "experiment=smoke"]
    cfg = compose(argv)
    before = _plain(cfg)
    assert _plain(resolve_config(cfg, argv, tmp_path, lambda: compose([]), conf_dir())) == before


def test_a_value_the_schema_refuses_names_the_file_and_key(tmp_path, caplog):
    old = _start(tmp_path)
    old["trainer"]["num_generations"] = "many"
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    with pytest.raises(ConfigError, match=r"config.yaml': trainer.num_generations='many'"):
        _resume(tmp_path, [])
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.train"):
        new = _resume(tmp_path, ["trainer.allow_config_change=true"])
    assert new["trainer"]["num_generations"] == compose([]).trainer.num_generations  # the command's
    assert "num_generations='many'" in caplog.text


def test_a_cut_short_config_yaml_is_still_reported_as_such(tmp_path):
    old = _start(tmp_path)
    del old["seed"], old["trainer"]["lr"]
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    new = _resume(tmp_path, [])
    assert new["trainer"]["lr"] == compose([]).trainer.lr  # the composed value
    with pytest.raises(ConfigError, match=r"lacks 2 key\(s\).*cut short"):
        check_resume_config(OmegaConf.create(new), tmp_path)


def test_a_key_outside_the_schema_is_not_carried_over_and_is_refused(tmp_path):
    old = _start(tmp_path)
    old["trainer"]["lr_typo"] = 0.1
    old["model"]["params"]["kept"] = 2  # under a free mapping: the run's own setting
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    new = _resume(tmp_path, [])
    assert "lr_typo" not in new["trainer"] and new["model"]["params"]["kept"] == 2
    with pytest.raises(ConfigError, match=r"changes the experiment \(trainer.lr_typo: 0.1 -> None"):
        check_resume_config(OmegaConf.create(new), tmp_path)


def test_every_rank_must_run_the_same_config():
    cfg = compose(["experiment=smoke", "output_dir=a"])
    other = compose(["experiment=smoke", "output_dir=b", "seed=3"])
    agree_on_config(cfg, None)  # one process: nothing to compare
    agree_on_config(cfg, lambda d: [d, config_digest(compose(["experiment=smoke"]))])
    with pytest.raises(ConfigError, match=r"rank\(s\) 1 run another config than rank 0"):
        agree_on_config(cfg, lambda d: [d, config_digest(other)])


# ------------------------------------------------------------------ the command line

START = [
    *ORIGINAL[:4],
    "trainer.steps=2",
    "trainer.save_every=2",
    "trainer.eval_at_start=false",
    "trainer.eval_every=0",
    "trainer.export_hf=false",
    "task.eval_size=4",
]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A run started with overrides (experiment=smoke d3s=pods ...): 2 steps, a checkpoint."""
    out = tmp_path_factory.mktemp("started") / "run"
    r = cli([*START, f"output_dir={out}"], timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in checkpoint_dirs(out / "checkpoints")] == ["step_000002"]
    return out


@pytest.mark.slow  # a whole program run (or several): the slow tier
def test_cli_resume_with_output_dir_alone_continues_the_run(started, tmp_path):
    alone, full = tmp_path / "alone", tmp_path / "full"
    shutil.copytree(started, alone)
    shutil.copytree(started, full)
    r = cli([f"output_dir={alone}", "resume=true", "trainer.steps=4"], timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {alone}/checkpoints/step_000002 (step 2)" in r.stdout + r.stderr
    resumed = OmegaConf.load(alone / "config.resumed-1.yaml")
    assert resumed.d3s.preset == "pods" and resumed.model.name == "tiny-random"
    assert resumed.trainer.steps == 4
    # the same as resuming with the original command line repeated
    r = cli([*START, f"output_dir={full}", "resume=true", "trainer.steps=4"], timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_jsonl(alone / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert without_timing(rows) == without_timing(read_jsonl(full / "metrics.jsonl"))


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_cli_resume_with_a_conflicting_override_is_refused_naming_the_keys(started, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(started, run)
    r = cli([f"output_dir={run}", "resume=true", "d3s=grpo"], timeout=WAIT_S)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: resume=true with a config that changes the experiment (")
    assert "d3s.preset: 'pods' -> 'grpo'" in err and "model." not in err, err
    assert not (run / "config.resumed-1.yaml").exists()


# ------------------------------------------------------------------ no checkpoint


def test_resume_on_a_folder_without_a_checkpoint_warns_naming_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="nemo_d3s"):
        state, rows = run_inprocess(tmp_path, [*FAST, "trainer.steps=1", "resume=true"])
    assert state.step == 1 and len(rows) == 1
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"output_dir={tmp_path} holds no checkpoint" in r.getMessage()
        and "fresh run from step 0" in r.getMessage()
        for r in warned
    ), [r.getMessage() for r in caplog.records]


def test_save_every_0_writes_no_checkpoint_and_a_resume_says_it_starts_afresh(tmp_path, caplog):
    args = [*FAST, "trainer.steps=3", "trainer.save_every=0", "trainer.export_hf=true"]
    state, rows = run_inprocess(tmp_path, args)
    assert state.step == 3 and len(rows) == 3
    assert checkpoint_dirs(tmp_path / "checkpoints") == []
    assert (tmp_path / "hf_export" / "config.json").is_file()  # the policy is kept there
    with caplog.at_level(logging.WARNING, logger="nemo_d3s"):
        state, rows = run_inprocess(tmp_path, [*args, "trainer.steps=4", "resume=true"])
    assert state.step == 4 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "holds no checkpoint" in caplog.text
    assert (tmp_path / "previous-1" / "metrics.jsonl").is_file()  # the first run's, kept


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_resume_from_the_folder_alone(tmp_path):
    """2 gloo ranks: each merges config.yaml itself before the process group exists, and
    they check that they agree (``agree_on_config``); the run continues with its preset."""
    import subprocess
    import sys

    from .conftest import REPO, cli_env

    def torchrun(args):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", "-m", "nemo_d3s.train", *args],
            cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=WAIT_S,
        )  # fmt: skip

    out = tmp_path / "run"
    r = torchrun([*START, f"output_dir={out}"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = torchrun([f"output_dir={out}", "resume=true", "trainer.steps=3"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"resumed from {out}/checkpoints/step_000002 (step 2)" in r.stdout + r.stderr
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert OmegaConf.load(out / "config.resumed-1.yaml").d3s.preset == "pods"
