"""Config schema, range validation, presets, and the CLI's config printing."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nemo_d3s.config import ConfigError, TrainConfig, validate
from nemo_d3s.core.d3s import PRESETS
from nemo_d3s.trainer.build import d3s_config

from .conftest import cli, compose


def _error(overrides, world_size=1) -> str:
    cfg = compose([*overrides, "output_dir=/tmp/unused"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size)
    return str(e.value)


def test_default_and_smoke_configs_validate():
    validate(compose(["output_dir=x"]))
    validate(compose(["experiment=smoke", "output_dir=x"]))
    validate(OmegaConf.structured(TrainConfig))


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.num_generations=1", "trainer.num_generations"),
        ("d3s.schedule.k_init=0", "d3s.schedule.k_init"),
        ("d3s.schedule.k_final=1.5", "d3s.schedule.k_final"),
        ("d3s.schedule.n_final=0.0", "d3s.schedule.n_final"),
        ("trainer.lr=0", "trainer.lr"),
        ("trainer.lr=-1e-5", "trainer.lr"),
        ("trainer.steps=0", "trainer.steps"),
        ("trainer.prompts_per_step=0", "trainer.prompts_per_step"),
        ("trainer.temperature=0", "trainer.temperature"),
        ("trainer.top_p=0", "trainer.top_p"),
        ("trainer.num_mini_batches=9", "trainer.num_mini_batches"),
        ("algorithm.loss=ppo", "algorithm.loss"),
        ("algorithm.aggregation=mean", "algorithm.aggregation"),
        ("d3s.sample_rule=best", "d3s.sample_rule"),
        ("d3s.token_scope=global", "d3s.token_scope"),
        ("d3s.schedule.kind=exp", "d3s.schedule.kind"),
        ("d3s.min_kept_tokens=-1", "d3s.min_kept_tokens"),
        ("d3s.dp_batch_scope=approx", "d3s.dp_batch_scope"),
    ],
)
def test_out_of_range_values_name_the_key(override, key):
    assert key in _error([override])


def test_g_equal_one_explains_why():
    msg = _error(["trainer.num_generations=1"])
    assert ">= 2 rollouts" in msg


def test_n_larger_than_g():
    msg = _error(["trainer.num_generations=4", "d3s.schedule.n_init=8", "d3s.schedule.n_final=8"])
    assert "d3s.schedule.n_init=8" in msg and "num_generations=4" in msg


def test_mixed_int_float_n_is_rejected():
    assert "d3s.schedule" in _error(["d3s.schedule.n_final=2"])


def test_prompts_must_shard_evenly_over_ranks():
    assert "trainer.prompts_per_step" in _error(["trainer.prompts_per_step=3"], world_size=2)


def test_unknown_key_fails_naming_it():
    # Plain override: Hydra refuses it against the schema.
    with pytest.raises(Exception, match="foo"):
        compose(["trainer.foo=1", "output_dir=x"])
    # "+key" bypasses Hydra's struct flag; validate() still catches it.
    assert "trainer.foo" in _error(["+trainer.foo=1"])
    assert "bogus" in _error(["+bogus=1"])


def _assert_selects_as(cfg, preset):
    ours, core = d3s_config(cfg), PRESETS[preset]
    for field in ("sample_rule", "token_scope", "advantage", "eps", "unbiased", "min_kept_tokens"):
        assert getattr(ours, field) == getattr(core, field), field
    for p in (0.0, 0.3, 1.0):
        assert ours.schedule.at(p) == core.schedule.at(p)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_yaml_matches_core_presets(preset):
    cfg = compose([f"d3s={preset}", "output_dir=x"])
    assert cfg.d3s.preset == preset
    _assert_selects_as(cfg, preset)


def test_schema_defaults_are_the_d3s_preset():
    # config.D3SSection repeats the d3s preset's values (floor, schedule) as the schema's defaults
    _assert_selects_as(OmegaConf.structured(TrainConfig), "d3s")


def test_cli_prints_resolved_config():
    r = cli(["--cfg", "job", "d3s=pods", "algorithm=gspo"])
    assert r.returncode == 0, r.stderr
    job = OmegaConf.create(r.stdout)
    assert job.d3s.preset == "pods" and job.algorithm.loss == "gspo"
    assert job.model.name == "smollm2-135m-instruct"


def test_cli_cfg_job_resolve_prints_the_output_path():
    """README: `--cfg job` shows output_dir as its ${now:...} pattern; `--resolve` fills it in."""
    import re

    plain = cli(["--cfg", "job"])
    assert "output_dir: outputs/${now:%Y-%m-%d_%H-%M-%S}" in plain.stdout, plain.stdout[:300]
    r = cli(["--cfg", "job", "--resolve"])
    assert r.returncode == 0, r.stderr
    assert re.search(r"^output_dir: outputs/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d$", r.stdout, re.M), r.stdout[:300]


def test_cli_reports_config_error_without_traceback(tmp_path):
    r = cli(["experiment=smoke", f"output_dir={tmp_path}", "trainer.num_generations=1"])
    assert r.returncode == 2
    assert "trainer.num_generations=1" in r.stderr and "Traceback" not in r.stderr


def test_evidence_task_has_two_digit_terms_and_a_large_eval_set():
    from nemo_d3s.trainer.tasks_adapter import build_task

    cfg = compose(["task=basic_arithmetic_2d", "output_dir=x"])
    validate(cfg)
    params = OmegaConf.to_container(cfg.task.params, resolve=True)
    task = build_task(cfg.task.name, params)
    problems = task.eval_set()
    assert len(problems) == 256 == len({p.prompt for p in problems})
    # the default's eval problems use single digits only; here some term has two
    assert any(any(len(tok) == 2 for tok in p.meta["question"].replace(".", " ").split() if tok.isdigit())
               for p in problems)


@pytest.mark.parametrize("extra", [["model=megatron"], [], ["model=smollm2"]])
def test_smoke_experiment_keeps_the_tiny_model_whatever_model_is_picked(extra):
    """`model=megatron experiment=smoke` once trained SmolLM2 (GBs of checkpoints): the smoke
    experiment pins the tiny random model on every backend."""
    cfg = compose([*extra, "experiment=smoke", "output_dir=x"])
    assert cfg.model.name == "tiny-random"
    if extra == ["model=megatron"]:
        assert cfg.model.backend == "megatron"


def test_megatron_smoke_experiment_is_tiny_tp2_and_keeps_one_checkpoint():
    cfg = compose(["experiment=megatron_smoke", "output_dir=x"])
    assert (cfg.model.backend, cfg.model.name) == ("megatron", "tiny-random")
    assert cfg.model.params.tensor_model_parallel_size == 2 and cfg.trainer.keep_last == 1
    validate(cfg, world_size=2)
