"""Config schema, range validation, presets, and the CLI's config printing."""

from __future__ import annotations

import re

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.config import (
    AlgorithmConfig,
    ConfigError,
    D3SSection,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    ScheduleConfig,
    TaskConfig,
    TrainConfig,
    TrainerConfig,
    register_configs,
    validate,
)
from nemo_d3s.core.d3s import PRESETS, D3SConfig
from nemo_d3s.trainer.build import checked_backend_config, d3s_config

from .conftest import REPO, cli, compose


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
        ("d3s.zero_advantage_tokens=maybe", "d3s.zero_advantage_tokens"),
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


@pytest.mark.parametrize(
    "overrides, key",
    [
        # pods' N = 1/4 of G: 0.25 x 4 = 1 (rounded half up) for the whole run
        (["trainer.num_generations=4"], "d3s.schedule.n_init=0.25 keeps 1 of the 4"),
        # linear 0.5 -> 0.25 at G = 5: 2.5 -> 3 at p = 0, 1.25 -> 1 at p = 1
        (
            ["trainer.num_generations=5", "d3s.schedule.kind=linear", "d3s.schedule.n_init=0.5"],
            "d3s.schedule.n_final=0.25 keeps 1 of the 5",
        ),
        (["d3s.schedule.n_init=1", "d3s.schedule.n_final=1"], "d3s.schedule.n_init=1 keeps 1 of"),
    ],
)
def test_pods_keeping_one_rollout_per_prompt_is_refused(overrides, key):
    """PODS re-normalises on the kept subset: one rollout's advantage is (r - r) / eps = 0."""
    msg = _error(["d3s=pods", *overrides])
    assert msg.startswith(key) and "nothing would be learned" in msg, msg
    assert "\n" not in msg
    # 0.25 x 6 = 1.5 -> 2 kept: accepted
    validate(compose(["d3s=pods", "trainer.num_generations=6", "output_dir=x"]))


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
def test_d3s_group_options_are_the_core_presets(preset):
    cfg = compose([f"d3s={preset}", "output_dir=x"])
    assert cfg.d3s.preset == preset
    _assert_selects_as(cfg, preset)


def test_presets_have_one_source(monkeypatch):
    """The d3s group and the schema's defaults are built from core PRESETS (no YAML copy to
    keep equal): changing a preset there changes what `d3s=<name>` composes."""
    assert not list((REPO / "conf" / "d3s").glob("*.yaml"))
    assert [o for o in ConfigStore.instance().list("d3s") if o.endswith(".yaml")] == [
        f"{n}.yaml" for n in sorted(PRESETS)
    ]
    _assert_selects_as(OmegaConf.structured(TrainConfig), "d3s")
    assert D3SSection() == D3SSection.from_preset("d3s")
    monkeypatch.setitem(PRESETS, "pods", D3SConfig.from_preset("pods", min_kept_tokens=7))
    try:
        assert compose(["d3s=pods", "output_dir=x"]).d3s.min_kept_tokens == 7
    finally:
        monkeypatch.undo()
        register_configs()
    assert compose(["d3s=pods", "output_dir=x"]).d3s.min_kept_tokens == 0


def test_overrides_on_top_of_a_preset_still_work():
    cfg = compose(
        [
            "d3s=pods",
            "d3s.schedule.kind=linear",
            "d3s.schedule.n_init=2",
            "d3s.schedule.n_final=4",
            "d3s.min_kept_tokens=16",
            "output_dir=x",
        ]
    )
    validate(cfg)
    ours = d3s_config(cfg)
    assert (
        ours.sample_rule == "pods" and ours.min_kept_tokens == 16 and ours.schedule.at(1.0)[0] == 4
    )


@pytest.mark.parametrize(
    "section, kwargs, key",
    [
        (TrainerConfig, {"lr": 0.0}, "trainer.lr"),
        (TrainerConfig, {"temperature": 0.0}, "trainer.temperature"),
        (TrainerConfig, {"top_p": 1.5}, "trainer.top_p"),
        (ScheduleConfig, {"k_init": 0.0}, "d3s.schedule.k_init"),
        (D3SSection, {"min_kept_tokens": -1}, "d3s.min_kept_tokens"),
        (D3SSection, {"sample_rule": "best"}, "d3s.sample_rule"),
        (AlgorithmConfig, {"dual_clip_c": 0.5}, "algorithm.dual_clip_c"),
        (RolloutConfig, {"gpu_memory_utilization": 2.0}, "rollout.gpu_memory_utilization"),
        (TaskConfig, {"eval_size": 0}, "task.eval_size"),
        (LoggingConfig, {"level": "VERBOSE"}, "logging.level"),
        (ModelConfig, {"device": "gpu"}, "model.device"),
    ],
)
def test_each_section_checks_its_own_fields_where_it_is_built(section, kwargs, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        section(**kwargs)


def test_sampling_settings_are_judged_once_by_the_generation_config():
    # the engines no longer repeat the check: building the GenerationConfig is the check
    with pytest.raises(ValueError, match=r"top_p=0.0: must be in \(0, 1\]"):
        GenerationConfig(top_p=0.0)
    with pytest.raises(ValueError, match="temperature=0"):
        GenerationConfig(temperature=0)
    GenerationConfig(temperature=0, do_sample=False)  # greedy: temperature unused
    assert "trainer.top_p=0.0: must be in (0, 1]" in _error(["trainer.top_p=0.0"])
    for path in ("backends/hf/engine.py", "backends/vllm/engine.py"):
        assert (
            "top_p"
            not in (REPO / "nemo_d3s" / path)
            .read_text()
            .split("def generate", 1)[1]
            .split("\n    def ")[0]
        )


def test_zero_advantage_tokens_reaches_the_selector():
    cfg = compose(["d3s=d3s", "d3s.zero_advantage_tokens=drop", "output_dir=x"])
    validate(cfg)
    assert d3s_config(cfg).zero_advantage_tokens == "drop"


def test_the_pods_renormalisation_offset_and_baselines_are_run_options():
    cfg = compose(["d3s=pods", "d3s.renorm_eps=0.01", "output_dir=x"])
    validate(cfg)
    assert d3s_config(cfg).renorm_eps == 0.01
    assert d3s_config(compose(["d3s=pods", "output_dir=x"])).renorm_eps is None  # 1e-4
    validate(compose(["d3s=pods", "d3s.sample_rule=pods_max_reward", "output_dir=x"]))
    assert "d3s.renorm_eps" in _error(["d3s=pods", "d3s.renorm_eps=-1"])


def test_milestones_of_a_schedule_that_has_none_are_refused_not_dropped():
    msg = _error(["d3s.schedule.kind=linear", "d3s.schedule.milestones=[0.3]"])
    assert "d3s.schedule.milestones" in msg and "only kind=step" in msg
    ok = compose(["d3s.schedule.kind=step", "d3s.schedule.milestones=[0.3]", "output_dir=x"])
    validate(ok)  # and an empty list at kind=step is the core's default, 0.5
    validate(compose(["d3s.schedule.kind=step", "output_dir=x"]))


def test_stale_rollouts_need_a_sampler_that_returns_their_log_probs():
    """hf_generate returns no behaviour log-probs: with rollout.max_staleness > 0 the
    off-policy correction (algorithm.tis_cap) silently did nothing, and its one-seed-per-call
    RNG is the process's, drawn from the rollout thread while the trainer runs."""
    stale = ["rollout.max_staleness=1", "+model.params.sampler=hf_generate"]
    assert _error(stale).startswith("rollout.max_staleness=1: trains on rollouts of older")
    validate(compose([*stale[1:], "output_dir=x"]))  # synchronous: its own sampler, fine
    validate(compose(["rollout.max_staleness=1", "+model.params.sampler=seeded", "output_dir=x"]))


@pytest.mark.parametrize("override", ["trainer.top_p=0.9", "trainer.top_k=40"])
def test_a_truncated_sampler_is_refused_as_its_rollouts_would_be_scored_untruncated(override):
    assert "sampling from a truncated distribution is not supported" in _error([override])


def test_the_backends_score_at_the_rollouts_temperature():
    from nemo_d3s.trainer.build import backend_settings

    common, _ = backend_settings(compose(["trainer.temperature=0.7", "output_dir=x"]))
    assert common["logit_temperature"] == 0.7
    cfg = compose(["trainer.temperature=0.7", "output_dir=x", "model.backend=megatron"])
    assert checked_backend_config(cfg).logit_temperature == 0.7


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "logging.level=VERBOSE",
            "logging.level='VERBOSE': unknown log level; known: DEBUG, INFO, WARNING",
        ),
        ("seed=-1", "seed=-1: must be an integer in [0, 4294967295]"),
        (
            "seed=18446744073709551616",
            "seed=18446744073709551616: must be an integer in [0, 4294967295]",
        ),
        ("model.device=gpu", "model.device='gpu': not a torch device"),
    ],
)
def test_values_that_used_to_fail_with_a_traceback_are_config_errors(override, message):
    assert message in _error([override])


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
    assert re.search(r"^output_dir: outputs/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d$", r.stdout, re.M), (
        r.stdout[:300]
    )


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
    assert any(
        any(len(tok) == 2 for tok in p.meta["question"].replace(".", " ").split() if tok.isdigit())
        for p in problems
    )


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


@pytest.mark.parametrize(
    "base, override",
    [
        (["model=megatron"], "transformer_impl=local"),
        (["experiment=qwen25_72b"], "use_tp_pp_dp_mapping=true"),
        (["experiment=qwen3_235b_a22b"], "distributed_optimizer=false"),
        ([], "sampler=hf_generate"),
        (["experiment=llama3_70b_32k"], "context_parallel_size=4"),
    ],
)
def test_the_backend_overrides_the_docs_and_errors_advise_compose(base, override):
    """The TE error, pyproject.toml, docs/scaling.md and the recipes' comments advised
    ``model.params.X=v`` for keys the composed config does not list: Hydra refused it ("To
    append to your config use +..."), and ``+`` fails where a recipe sets the key; ``++``
    works in both cases."""
    key, value = override.split("=")
    cfg = compose([*base, f"++model.params.{override}", "output_dir=x"])
    assert str(cfg.model.params[key]).lower() == value
