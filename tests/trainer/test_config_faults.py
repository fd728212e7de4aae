"""Issue 32: configuration faults that were silent or misleading: one source per setting
(``model.params`` cannot override the run's own settings), a mistyped key gets "did you
mean" and exit 2."""

from __future__ import annotations

import pytest

from nemo_d3s.config import ConfigError
from nemo_d3s.trainer.build import checked_backend_config

from .conftest import compose
from _limits import WAIT_S  # noqa: E402


@pytest.mark.parametrize(
    "override, source",
    [("+model.params.lr=0.5", "trainer.lr"), ("+model.params.seed=5", "seed")],
)
def test_model_params_cannot_override_a_run_setting(tmp_path, override, source):
    """+model.params.lr=0.5 trained at 0.5 while trainer.lr (and config.yaml) said 1e-3."""
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", override])
    with pytest.raises(ConfigError, match=rf"comes from {source}; set it there") as e:
        checked_backend_config(cfg)
    assert "one source per setting" in str(e.value)


def test_unknown_model_params_key_lists_only_the_backends_own_settings(tmp_path):
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "+model.params.bogus=1"])
    with pytest.raises(ConfigError, match="model.params.bogus: not a setting") as e:
        checked_backend_config(cfg)
    known = str(e.value).split("known: ", 1)[1].split(", ")
    assert "tiny" in known and "lr" not in known and "seed" not in known


@pytest.mark.parametrize("cp", [0, -2])
def test_context_parallel_size_below_one_says_must_be_1(tmp_path, cp):
    """It explained Transformer Engine's attention instead."""
    cfg = compose(
        ["experiment=megatron_smoke", f"output_dir={tmp_path}"]
        + [f"+model.params.context_parallel_size={cp}"]
    )
    with pytest.raises(
        ConfigError, match=rf"context_parallel_size={cp}: must be an integer >= 1"
    ) as e:
        checked_backend_config(cfg)
    assert "Transformer Engine" not in str(e.value)


def test_a_mistyped_key_says_did_you_mean_and_exits_2(tmp_path):
    """Hydra's answer was its "+key" advice and exit 1; nothing is written either way."""
    from .conftest import cli

    r = cli(["experiment=smoke", f"output_dir={tmp_path / 'run'}", "trainer.lrr=0.1"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: trainer.lrr: no such setting; did you mean trainer.lr?")
    assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_every_key_of_every_experiment_passes_the_key_check():
    """The check walks the schema: no real key (of any shipped experiment) is refused."""
    import glob
    import os

    from omegaconf import OmegaConf

    from nemo_d3s.train import conf_dir
    from nemo_d3s.trainer.overrides import unknown_key_error
    from nemo_d3s.trainer.run_start.config_file import leaf_keys

    groups = [p.name for p in conf_dir().iterdir() if p.is_dir()]
    for path in sorted(glob.glob(str(conf_dir() / "experiment" / "*.yaml"))):
        name = os.path.basename(path)[:-5]
        keys = leaf_keys(OmegaConf.to_container(compose([f"experiment={name}"]), resolve=False))
        assert not [k for k in keys if unknown_key_error([f"{k}=1"], groups)], name


def test_a_home_path_on_the_command_line_is_expanded():
    """The README's ``model.name=~/models/qwen-0.5b`` failed as written: the shell leaves ``~``
    after ``key=`` and Hydra's grammar refuses it (LexerNoViableAltException)."""
    import os

    from nemo_d3s.trainer.overrides import expand_home

    home = os.path.expanduser("~")
    assert expand_home(["model.name=~/models/q", "output_dir='~/runs/a'", "x=~", "-m"]) == [
        f"model.name={home}/models/q",
        f"output_dir='{home}/runs/a'",
        f"x={home}",
        "-m",
    ]
    kept = ["~model.params.tiny", "a=b~/c", "d=~~", "e="]
    assert expand_home(kept) == kept


@pytest.mark.slow
def test_the_readmes_own_model_command_runs_with_a_home_path(tmp_path):
    """``python -m nemo_d3s.train output_dir=~/run ...`` with HOME pointing here: the run
    writes under HOME, and no folder named ``~`` appears where it was started."""
    import subprocess
    import sys

    from .conftest import FAST, cli_env

    env = {**cli_env(), "HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", "experiment=smoke", *FAST, "trainer.steps=1"]
        + ["output_dir=~/run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and not (tmp_path / "~").exists()
