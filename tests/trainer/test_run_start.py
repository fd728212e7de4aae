"""The run's start (``trainer/run_start``): a resume trusts only what it can prove. The config
and data record a resume checks come from the newest checkpoint's ``run_record.json`` (covered
by its checksums), else ``config.yaml`` / ``data_files.json``; a folder with checkpoints and
neither is refused, a foreign ``config.yaml`` is named as such, and a finished run is not
rewound to an older checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from _limits import WAIT_S  # noqa: E402

from nemo_d3s.config import ConfigError
from nemo_d3s.files import write_checksums
from nemo_d3s.train import conf_dir, run_cli
from nemo_d3s.trainer.checkpoint import RUN_RECORD
from nemo_d3s.trainer.metrics import read_jsonl
from nemo_d3s.trainer.run_start import decide, resolve_config, trusted_run_config
from nemo_d3s.trainer.run_start.decision import run_record

from .conftest import FAST, PODS_SMOKE, compose


def _cfg(out: Path, argv, resume=False):
    """The config ``python -m nemo_d3s.train`` runs for ``argv`` in ``out`` (the resumed base
    included, as train.py builds it)."""
    argv = [f"output_dir={out}", *(["resume=true"] if resume else []), *argv]
    cfg = compose(argv)
    OmegaConf.resolve(cfg)
    return resolve_config(cfg, argv, out, lambda: compose([]), conf_dir())


def _fake_run(out: Path, argv, steps=(1,), record=True) -> dict:
    """A run folder as training leaves it, without training: config.yaml and checkpoints
    ``step_<s>`` with trainer_state.json, the run record (``record``) and checksums.json."""
    cfg = _cfg(out, argv)
    plain = OmegaConf.to_container(cfg, resolve=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(plain)))
    for s in steps:
        ck = out / "checkpoints" / f"step_{s:06d}"
        ck.mkdir(parents=True)
        (ck / "trainer_state.json").write_text(json.dumps({"step": s}))
        if record:
            (ck / RUN_RECORD).write_text(json.dumps(run_record(cfg)))
        write_checksums(ck)
    return plain


PODS = ["experiment=smoke", *PODS_SMOKE, "trainer.steps=30"]


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_a_lost_config_yaml_is_replaced_by_the_checkpoints_own_config(tmp_path, damage):
    """config.yaml deleted or garbled, resume with overrides: the composed default (d3s, not
    pods) stood in for the run's config and the resumed run trained another experiment."""
    out = tmp_path / "run"
    _fake_run(out, PODS)
    if damage == "missing":
        (out / "config.yaml").unlink()
    else:
        (out / "config.yaml").write_text("seed: [0\n")
    for extra in ([], ["trainer.steps=12"], ["trainer.allow_config_change=true"]):
        cfg = _cfg(out, extra, resume=True)
        assert cfg.d3s.preset == "pods" and cfg.model.name == "tiny-random", extra
        assert cfg.trainer.steps == (12 if extra == ["trainer.steps=12"] else 30)
        d = decide(cfg, out)
        assert d.kind == "resume" and RUN_RECORD in d.config_from, d
    with pytest.raises(ConfigError, match=r"d3s.preset: 'pods' -> 'grpo'"):
        decide(_cfg(out, ["d3s=grpo"], resume=True), out)


@pytest.mark.parametrize("allow", [False, True])
def test_checkpoints_without_a_config_and_no_config_yaml_are_refused(tmp_path, allow):
    """Checkpoints of an earlier version (no run record) and config.yaml gone: nothing tells
    what the run trained with; refused even with allow_config_change (it would run the
    default config on the checkpoint without a word)."""
    out = tmp_path / "run"
    _fake_run(out, PODS, record=False)
    (out / "config.yaml").unlink()
    extra = ["trainer.allow_config_change=true"] if allow else []
    with pytest.raises(ConfigError, match=r"config.yaml' is missing and the checkpoints .* carry"):
        _cfg(out, extra, resume=True)
    with pytest.raises(ConfigError, match=r"restore the run's config.yaml"):
        trusted_run_config(out)


def test_a_foreign_config_yaml_is_named_as_such(tmp_path):
    out = tmp_path / "run"
    _fake_run(out, PODS, record=False)
    (out / "config.yaml").write_text("name: my-web-app\nport: 8080\n")
    with pytest.raises(ConfigError) as e:
        _cfg(out, [], resume=True)
    assert "is not a run's config (a mapping of name, port" in str(e.value)
    assert "cut short" not in str(e.value) and "layout" not in str(e.value)
    # with the checkpoint's own config the file is only warned about
    shutil.rmtree(out)
    _fake_run(out, PODS)
    (out / "config.yaml").write_text("name: my-web-app\n")
    assert _cfg(out, [], resume=True).d3s.preset == "pods"


def test_an_older_checkpoints_config_is_checked_when_the_newer_one_is_corrupt(tmp_path):
    out = tmp_path / "run"
    _fake_run(out, PODS, steps=(1, 2))
    newest = out / "checkpoints" / "step_000002"
    rec = json.loads((newest / RUN_RECORD).read_text())
    rec["config"]["seed"] = 7
    (newest / RUN_RECORD).write_text(json.dumps(rec))  # not what checksums.json says
    cfg, where = trusted_run_config(out)
    assert cfg["seed"] == 0 and "step_000001" in where  # the corrupt record is not trusted


def test_a_finished_run_is_not_rewound_to_an_older_checkpoint(tmp_path):
    """save_every=0: a stop signal's checkpoint at step 1, then the run resumed and finished
    (summary.json, 2 steps, no checkpoint at the end). resume=true rewound it to step 1 and
    trained step 2 again over its records."""
    out = tmp_path / "run"
    _fake_run(out, ["experiment=smoke", *FAST], steps=(1,))
    (out / "summary.json").write_text(json.dumps({"steps": 2}))
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ConfigError) as e:
        decide(_cfg(out, [], resume=True), out)
    msg = str(e.value)
    assert "holds a finished run (summary.json: 2 steps)" in msg and "step_000001" in msg
    assert "rewind it to step 1" in msg
    assert read_jsonl(out / "metrics.jsonl") == [{"step": 1}, {"step": 2}]


def test_a_resume_trains_from_the_checkpoints_config_end_to_end(tmp_path, capsys):
    """A real run: 2 steps of pods (a checkpoint each), config.yaml deleted, then
    ``output_dir=X resume=true trainer.steps=3``: it continues as pods from step 2."""
    out = tmp_path / "run"
    argv = ["experiment=smoke", *FAST, *PODS_SMOKE, "trainer.save_every=1", "seed=3"]
    assert run_cli(_cfg(out, argv)) == 0
    (out / "config.yaml").unlink()
    cfg = _cfg(out, ["trainer.steps=3"], resume=True)
    assert cfg.d3s.preset == "pods" and cfg.seed == 3
    assert run_cli(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    rec = json.loads((out / "checkpoints" / "step_000003" / RUN_RECORD).read_text())
    assert rec["config"]["d3s"]["preset"] == "pods" and rec["config"]["trainer"]["steps"] == 3


def test_a_deletion_on_resume_is_of_the_runs_own_key(tmp_path):
    """``output_dir=X resume=true ~model.params.tiny`` on a smoke run: Hydra refused it
    ("Could not delete from config. 'model.params.tiny' does not exist": the default config it
    composes lacks the key the run has). The deletion is held back from Hydra and applied to
    the run's own config; the resume check then names it as a change of the experiment."""
    from nemo_d3s.train import conf_dir as conf
    from nemo_d3s.trainer.overrides import resume_deletions

    out = tmp_path / "run"
    _fake_run(out, ["experiment=smoke"])
    groups = [p.name for p in conf().iterdir() if p.is_dir()]
    argv = [f"output_dir={out}", "resume=true", "~model.params.tiny"]
    hydra_argv, held = resume_deletions(argv, groups)
    assert held == ["~model.params.tiny"] and hydra_argv == argv[:2]
    assert resume_deletions(argv[1:] + ["~experiment"], groups)[1] == ["~model.params.tiny"]
    assert resume_deletions(["~model.params.tiny"], groups) == (["~model.params.tiny"], [])
    cfg = compose(hydra_argv)
    OmegaConf.resolve(cfg)
    cfg = resolve_config(cfg, hydra_argv + held, out, lambda: compose([]), conf_dir())
    assert cfg.model.name == "tiny-random" and "tiny" not in cfg.model.params
    with pytest.raises(ConfigError, match=r"changes the experiment \(model.params.tiny"):
        decide(cfg, out)
    for bad, why in (("~trainer.lr", "cannot be deleted"), ("~model.params.nope", "no such key")):
        cfg = compose(hydra_argv)
        OmegaConf.resolve(cfg)
        with pytest.raises(ConfigError, match=why):
            resolve_config(cfg, [*hydra_argv, bad], out, lambda: compose([]), conf_dir())


def test_a_deletion_under_resume_on_a_fresh_folder_applies_to_the_composed_config(tmp_path):
    """``resume=true`` on a folder without a run (the sbatch scripts' first start): the held
    ``~key`` deletions apply to the composed config, and a key it lacks is refused."""
    from nemo_d3s.train import conf_dir as conf
    from nemo_d3s.trainer.overrides import resume_deletions

    out = tmp_path / "fresh"
    groups = [p.name for p in conf().iterdir() if p.is_dir()]
    argv = ["experiment=smoke", f"output_dir={out}", "resume=true", "~model.params.tiny"]
    hydra_argv, held = resume_deletions(argv, groups)
    cfg = compose(hydra_argv)
    OmegaConf.resolve(cfg)
    assert "tiny" in cfg.model.params
    cfg = resolve_config(cfg, hydra_argv + held, out, lambda: compose([]), conf_dir())
    assert "tiny" not in cfg.model.params and cfg.model.name == "tiny-random"
    cfg = compose(hydra_argv)
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match="no such key"):
        resolve_config(
            cfg, [*hydra_argv, "~model.params.nope"], out, lambda: compose([]), conf_dir()
        )


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_a_deletion_on_resume_from_the_command_line_is_one_error_line(tmp_path):
    from .conftest import cli

    out = tmp_path / "run"
    _fake_run(out, ["experiment=smoke"])
    r = cli([f"output_dir={out}", "resume=true", "~model.params.tiny"], timeout=WAIT_S)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: resume=true with a config that changes the experiment")
    assert "model.params.tiny" in lines[-1] and "Could not delete" not in r.stderr
