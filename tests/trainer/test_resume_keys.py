"""Issue 32: which keys a resumed run may change, derived from the schema, so that a
widened ``RESUME_SAFE`` (a mutant adding ``trainer.`` passed every test) fails here:
every schema key outside the expected safe set is tried and must be refused, and the set
the code judges safe must be exactly the expected one."""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from nemo_d3s.config import ConfigError
from nemo_d3s.trainer.overrides import schema_keys
from nemo_d3s.trainer.run_start.config_file import (
    compare_config,
    leaf_keys,
    read_run_config,
    refuse_records,
    resume_safe,
)
from nemo_d3s.trainer.run_start.config_merge import resolve_config
from nemo_d3s.trainer.run_start.decision import trusted_run_config

from .conftest import REPO, compose


def check_resume_config(cfg, folder):
    """The resume's config check as the start runs it: against the config the run trusts."""
    compare_config(cfg, *trusted_run_config(folder))


# What may change on resume without making another experiment (resources, cadence,
# logging, the parallel layout); written out here, not read from the code under test.
EXPECTED_SAFE = {
    "resume",
    "output_dir",
    "logging.level",
    "logging.progress_bar",
    "logging.tensorboard",
    "logging.log_samples",
    "trainer.steps",
    "trainer.eval_every",
    "trainer.eval_at_start",
    "trainer.eval_batch_size",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.export_hf",
    "trainer.micro_batch_size",
    "trainer.logprob_micro_batch_size",
    "trainer.micro_batch_tokens",
    "trainer.logprob_micro_batch_tokens",
    "trainer.allow_config_change",
    "trainer.max_failed_reward_steps",
    "trainer.dist_timeout_minutes",
    "trainer.reward_workers",
    "trainer.dry_run",
    "trainer.gpu_memory_gb",
    "task.max_eval_size",
    "model.device",
    "model.gradient_checkpointing",
    "rollout.gpu_memory_utilization",
    "rollout.sleep",
    "rollout.enforce_eager",
    "rollout.cpu_kv_cache_gb",
    "rollout.refit_bucket_mb",
}


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, list):
        return [*value, 0.5]
    if isinstance(value, dict):
        return {**value, "added_on_resume": 1}
    return 1  # None


def _set(d, dotted, value):
    *head, last = dotted.split(".")
    for part in head:
        d = d[part]
    d[last] = value


def _get(d, dotted):
    for part in dotted.split("."):
        d = d[part]
    return d


@pytest.fixture(scope="module")
def original():
    cfg = compose(["experiment=smoke", "output_dir=run"])
    return OmegaConf.to_container(cfg, resolve=True)


def test_the_keys_judged_safe_are_exactly_the_expected_ones(original):
    keys = set(schema_keys())
    safe = {k for k in keys if resume_safe(k)}
    logging_keys = {k for k in keys if k.startswith("logging.")}
    assert safe == {k for k in EXPECTED_SAFE if k in keys} | logging_keys, sorted(
        safe ^ (EXPECTED_SAFE | logging_keys)
    )


def test_every_other_schema_key_changed_on_resume_is_refused(tmp_path, original):
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(original)))
    tried = 0
    for key in sorted(set(schema_keys()) & set(leaf_keys(original)) | {"model.params"}):
        if resume_safe(key):
            continue
        new = copy.deepcopy(original)
        _set(new, key, _other(_get(new, key)))
        with pytest.raises(ConfigError, match="changes the experiment") as e:
            check_resume_config(OmegaConf.create(new), tmp_path)
        assert key in str(e.value), key
        tried += 1
    assert tried >= 50  # the schema's experiment keys, every one of them


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_model_parallel_size": 1},
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        {"distributed_optimizer": True, "sequence_parallel": False},
    ],
)
def test_a_resume_at_another_megatron_layout_is_allowed(tmp_path, layout):
    """Checkpoints reshard to any TP x PP (docs/scaling.md); the resume check refused it as
    "changes the experiment"."""
    cfg = compose(["experiment=megatron_smoke", "output_dir=run"])
    old = OmegaConf.to_container(cfg, resolve=True)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    new = copy.deepcopy(old)
    new["model"]["params"].update(layout)
    check_resume_config(OmegaConf.create(new), tmp_path)  # no error


# A run's config.yaml as an earlier run, an editor or a full disk may have left it.
UNREADABLE = {
    "list": ("- 1\n- 2\n", "not a mapping but list"),
    "scalar": ("42\n", "int"),
    "garbled": ("seed: [0\ntrainer: {steps: \x07", ""),
    "bad_interpolation": ("seed: ${nowhere.key}\n", "nowhere"),
}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_one_reader_of_config_yaml_for_the_three_uses(tmp_path, original, kind):
    """read_run_config is the only reader: the fresh-run refusal, the resume check and the
    resumed config's base all see the same verdict on the same file. Without a checkpoint
    there is nothing to continue (the composed config stands); with checkpoints that carry no
    config of their own, the resume is refused naming the file."""
    text, why_part = UNREADABLE[kind]
    assert read_run_config(tmp_path) == (None, None)  # no file
    (tmp_path / "config.yaml").write_text(text)
    old, why = read_run_config(tmp_path)
    assert old is None and why and why_part in why, why
    cfg = OmegaConf.create({**original, "resume": True})
    with pytest.raises(ConfigError, match=r"config.yaml' cannot be read .* a fresh run would"):
        refuse_records(tmp_path, cfg)
    assert resolve_config(cfg, [], tmp_path, lambda: cfg, REPO / "conf") is cfg
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    for check in (
        lambda: check_resume_config(cfg, tmp_path),
        lambda: resolve_config(cfg, [], tmp_path, lambda: cfg, REPO / "conf"),
    ):
        with pytest.raises(ConfigError, match=r"config.yaml' cannot be read .* carry no config"):
            check()

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(original)))
    assert read_run_config(tmp_path) == (original, None)
