"""conf/ repeats the schema's defaults (so that a reader of a YAML file sees every setting);
the schema (nemo_d3s/config*.py) is their one home, and this keeps the two equal. The
options ``conf/config.yaml`` picks by default must equal the schema's defaults key by key,
and ``rollout/vllm.yaml`` lists vLLM's settings at their defaults (``VLLMEngineConfig``).
The ``d3s`` group is generated from ``core.presets`` (no YAML); ``task`` options choose a
task (the default option is not the schema's task) and are not repeats."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from nemo_d3s.backends.vllm.config import VLLMEngineConfig
from nemo_d3s.config import (
    AlgorithmConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)

CONF = Path(__file__).resolve().parent.parent / "nemo_d3s" / "conf"
SECTIONS = {
    "algorithm": AlgorithmConfig,
    "model": ModelConfig,
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "logging": LoggingConfig,
}


def _default_options():
    entries = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if k in SECTIONS}


def _mismatches(values: dict, schema: object, where: str) -> list:
    return [
        f"{where}: {key}: {value!r} in conf/, {getattr(schema, key)!r} in the schema"
        for key, value in values.items()
        if value != getattr(schema, key)
    ]


def test_every_section_has_its_default_option():
    assert set(_default_options()) == set(SECTIONS)


@pytest.mark.parametrize("group", sorted(SECTIONS))
def test_the_default_options_repeat_the_schema_defaults_exactly(group):
    option = _default_options()[group]
    values = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    fields = {f.name for f in dataclasses.fields(SECTIONS[group])}
    assert set(values) <= fields, f"{group}/{option}.yaml has keys the schema lacks"
    assert _mismatches(values, SECTIONS[group](), f"{group}/{option}.yaml") == []


def test_the_root_values_repeat_the_schema_defaults():
    root = yaml.safe_load((CONF / "config.yaml").read_text())
    values = {k: root[k] for k in ("resume", "seed")}
    assert _mismatches(values, TrainConfig(), "config.yaml") == []


def test_the_vllm_option_lists_the_engine_settings_at_their_defaults():
    values = yaml.safe_load((CONF / "rollout" / "vllm.yaml").read_text())
    assert values.pop("engine") == "vllm"
    assert set(values) == {f.name for f in dataclasses.fields(VLLMEngineConfig)}
    assert _mismatches(values, VLLMEngineConfig(), "rollout/vllm.yaml") == []
