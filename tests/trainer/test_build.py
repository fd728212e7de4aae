"""The seam as the trainer builds it: policy -> layout -> validation, engine wrappers,
registry properties instead of name comparisons, settings a backend does not use."""

from __future__ import annotations

from typing import Protocol

import logging
from dataclasses import dataclass

import pytest
import torch

from nemo_d3s.backends.base import GenerationConfig, Policy, RolloutEngine, Rollouts, TokenBatch
from nemo_d3s.backends.wrappers import OneSeedPerCall, PerPromptCalls
from nemo_d3s.config import ConfigError, validate_layout
from nemo_d3s.core.registry import Registry
from nemo_d3s.core.sample_selection import SAMPLE_SELECTORS
from nemo_d3s.core.token_selection import TOKEN_SELECTORS
from nemo_d3s.trainer.backend_registry import backend_config
from nemo_d3s.trainer.build import rollout_engine

from .conftest import compose


class _OneSeedEngine(RolloutEngine):
    """Records its calls; each row's token is the call's seed, so the test can see which
    seed produced which prompt's samples."""

    prompt_seeds = False
    tokenizer = type("Tok", (), {"pad_token_id": 0})()

    def __init__(self):
        self.calls = []
        self.synced = []

    def generate(self, prompts, n_samples, cfg, seeds):
        assert isinstance(seeds, int)
        self.calls.append((list(prompts), seeds))
        B = len(prompts) * n_samples
        ids = torch.full((B, 2), seeds, dtype=torch.long)
        mask = torch.ones(B, 2, dtype=torch.bool)
        return Rollouts(
            TokenBatch(ids, mask, mask),
            torch.arange(len(prompts)).repeat_interleave(n_samples),
            [str(seeds)] * B,
            torch.ones(B, dtype=torch.bool),
        )

    def sync_weights(self, policy):
        self.synced.append(policy)


@dataclass
class _Policy:
    rollout_engine: RolloutEngine


def test_engine_without_prompt_seeds_is_wrapped_at_build_time():
    inner = _OneSeedEngine()
    cfg = compose(["experiment=smoke", "trainer.generate_per_prompt=true"])
    per_prompt = rollout_engine(_Policy(inner), cfg)
    assert isinstance(per_prompt, PerPromptCalls) and per_prompt.prompt_seeds
    out = per_prompt.generate(["a", "b", "c"], 2, GenerationConfig(), [7, 8, 9])
    assert inner.calls == [(["a"], 7), (["b"], 8), (["c"], 9)]
    assert out.batch.input_ids[:, 0].tolist() == [7, 7, 8, 8, 9, 9]
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    per_prompt.sync_weights("policy")
    assert inner.synced == ["policy"]  # the wrapper forwards the refit

    inner.calls.clear()
    cfg = compose(["experiment=smoke", "trainer.generate_per_prompt=false"])
    batched = rollout_engine(_Policy(inner), cfg)
    assert isinstance(batched, OneSeedPerCall)
    batched.generate(["a", "b"], 2, GenerationConfig(), [7, 8])
    assert inner.calls == [(["a", "b"], 7)]
    with pytest.raises(ValueError, match="one seed per prompt"):
        batched.generate(["a", "b"], 2, GenerationConfig(), [7])


def test_engine_with_prompt_seeds_is_used_as_is():
    inner = _OneSeedEngine()
    inner.prompt_seeds = True
    assert rollout_engine(_Policy(inner), compose(["experiment=smoke"])) is inner


def test_hf_policy_builds_its_layout_and_engine():
    from nemo_d3s.backends.hf import HFBackend, HFBackendConfig

    b = HFBackend(HFBackendConfig(model="tiny-random", device="cpu"))
    assert isinstance(b, Policy) and isinstance(b.rollout_engine, RolloutEngine)
    assert b.groups.dp_size == 1 and b.groups.device == torch.device("cpu")
    b.rollout_engine.sync_weights(b)  # shares the weights: nothing to move
    with pytest.raises(ValueError, match="policy it was built with"):
        b.rollout_engine.sync_weights(HFBackend(HFBackendConfig(model="tiny-random", device="cpu")))


def test_layout_is_validated_against_the_real_dp_size():
    cfg = compose(["experiment=smoke", "trainer.prompts_per_step=6"])
    validate_layout(cfg, 2)
    validate_layout(cfg, 3)
    with pytest.raises(ConfigError, match=r"trainer.prompts_per_step=6.*data-parallel ranks \(4\)"):
        validate_layout(cfg, 4)


def test_unused_common_settings_are_a_notice_not_silence(caplog):
    @dataclass
    class OnlyModel:
        model: str = "x"

    with caplog.at_level(logging.INFO, logger="nemo_d3s.trainer"):
        out = backend_config(
            OnlyModel, {"model": "m", "gradient_checkpointing": True, "use_reference": False}, {}
        )
    assert out.model == "m"
    assert "gradient_checkpointing=True" in caplog.text
    assert "use_reference" not in caplog.text  # a setting left at off is not worth a line
    with pytest.raises(ValueError, match="model.params.nope"):
        backend_config(OnlyModel, {}, {"nope": 1})


def test_registry_properties_replace_name_comparisons():
    assert SAMPLE_SELECTORS.prop("all", "keeps_all") and not SAMPLE_SELECTORS.prop(
        "pods", "keeps_all"
    )
    assert SAMPLE_SELECTORS.prop("d3s_cross", "pooled") and SAMPLE_SELECTORS.prop(
        "random", "pooled"
    )
    assert not SAMPLE_SELECTORS.prop("d3s_intra", "pooled")
    assert not TOKEN_SELECTORS.prop("all", "needs_entropy") and TOKEN_SELECTORS.prop(
        "sample", "needs_entropy"
    )
    assert TOKEN_SELECTORS.prop("batch", "spans_batch") and not TOKEN_SELECTORS.prop(
        "sample", "spans_batch"
    )

    class Thing(Protocol):
        def __call__(self) -> None: ...

    reg = Registry("thing", Thing, needs_x=False)
    with pytest.raises(ValueError, match="unknown properties"):
        reg.register("a", needs_y=True)
    reg.register("b", needs_x=True)(lambda: None)
    assert reg.properties("b") == {"needs_x": True}
    with pytest.raises(KeyError, match="no property"):
        reg.prop("b", "colour")
    with pytest.raises(ValueError, match="unknown thing 'c'"):
        reg.prop("c", "needs_x")


@pytest.mark.parametrize("value, want", [("true", True), ("false", False), ("null", None)])
def test_pack_sequences_reaches_the_backend_config(tmp_path, value, want):
    from nemo_d3s.trainer.build import checked_backend_config

    over = ["experiment=smoke", f"output_dir={tmp_path}", f"trainer.pack_sequences={value}"]
    assert checked_backend_config(compose(over)).pack_sequences is want
