"""Bad input gives a clear error or a counted, logged skip: never a silent wrong update."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from nemo_d3s.config import ConfigError
from nemo_d3s.core.presets import D3SConfig
from nemo_d3s.trainer.loop import Trainer

from . import _tasks  # noqa: F401  (registers test_constant, test_flaky)
from .conftest import FAST, cli, compose, run_inprocess


def test_all_equal_batch_skips_the_update_but_advances(tmp_path):
    state, rows = run_inprocess(
        tmp_path, [*FAST, "task.name=test_constant", "trainer.save_every=1"]
    )
    assert state.step == 2 and state.skipped_steps == 2
    for r in rows:
        assert r["skipped"] == 1 and r["skip_all_equal"] == 1
        assert r["n_degenerate_groups"] == r["n_prompts"]
        assert "update_tokens" not in r and "loss" not in r  # no update happened
    assert [r["progress"] for r in rows] == [0.0, 1.0]  # the schedule still advances
    assert rows[-1]["skipped_steps_total"] == 2
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()


def test_pods_keeping_one_rollout_per_prompt_skips_the_update(tmp_path, monkeypatch):
    """PODS keeping N = 1/4 of G = 4 = 1 rollout a prompt (the config refuses it; here that
    check is bypassed, as a caller of the selector could): the kept rollout's advantage
    re-normalised on itself is (r - r) / (0 + 1e-4) = 0 in every group, while the groups
    themselves are not all-equal. The step skips instead of taking a KL-only optimizer step."""
    monkeypatch.setattr(D3SConfig, "check_group_size", lambda self, group_size: None)
    over = [*FAST, "task.name=test_varied", "d3s=pods", "algorithm.kl_coef=0.1"]
    state, rows = run_inprocess(tmp_path, over)
    assert state.step == 2 and state.skipped_steps == 2
    for r in rows:
        assert r["skipped"] == 1 and r["skip_zero_advantage"] == 1 and "skip_all_equal" not in r
        assert r["n_kept_samples"] == r["n_prompts"] and r["share_nonzero_adv"] == 0.0
        assert "update_tokens" not in r and "loss" not in r  # no update happened
    log = (tmp_path / "train.log").read_text()
    assert "update skipped (every kept advantage was 0)" in log


def test_updates_with_a_non_finite_gradient_are_not_counted_as_trained(tmp_path, monkeypatch):
    """Every gradient norm non-finite: the backend applies nothing, so the rows say skipped
    (skipped_nonfinite 1, 0 optimizer steps) and no token counts as trained."""
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(math.nan))
    state, rows = run_inprocess(tmp_path, [*FAST, "task.name=test_varied"])
    assert state.skipped_steps == 2 and state.update_tokens_total == 0
    for r in rows:
        assert r["skipped"] == 1 and r["skipped_nonfinite"] == 1 and r["optimizer_steps"] == 0
        assert r["update_tokens"] == 0 and r["update_tokens_total"] == 0
    log = (tmp_path / "train.log").read_text()
    assert "update skipped (the gradient norm was not finite)" in log


def test_failing_reward_is_counted_and_does_not_poison_the_batch(tmp_path):
    state, rows = run_inprocess(
        tmp_path, [*FAST, "task.name=test_flaky", "trainer.max_new_tokens=4"]
    )
    assert state.step == 2
    assert sum(r["reward_errors"] for r in rows) > 0
    assert state.reward_errors_total == sum(r["reward_errors"] for r in rows)
    for r in rows:
        assert math.isfinite(r["reward_mean"])
        assert r["skipped"] == 1 or math.isfinite(r["loss"])


def test_missing_model_directory_is_a_clear_error(tmp_path):
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "model.name=/no/such/model"])
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        Trainer(cfg)


def test_missing_model_directory_cli_message(tmp_path):
    r = cli(["experiment=smoke", f"output_dir={tmp_path}", "model.name=/no/such/model"])
    assert r.returncode == 2
    assert "/no/such/model" in r.stderr and "Traceback" not in r.stderr


def test_dataset_row_without_answer_is_a_clear_error(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        json.dumps({"question": "1+1?", "answer": "2"})
        + "\n"
        + json.dumps({"question": "2+2?"})
        + "\n"
    )
    cfg = compose(
        [
            "experiment=smoke",
            f"output_dir={tmp_path / 'out'}",
            "task=jsonl_math",
            f"task.params.train_path={data}",
            "task.eval_size=1",
        ]
    )
    with pytest.raises(ConfigError, match="line 2 has no answer"):
        Trainer(cfg)


def test_unknown_backend_option_names_the_key(tmp_path):
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "+model.params.bogus=1"])
    with pytest.raises(ConfigError, match="model.params.bogus"):
        Trainer(cfg)


def test_megatron_backend_names_what_it_cannot_use(tmp_path):
    # the smoke experiment's HF-only model shape, then its in-memory model: clear errors
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "model.backend=megatron"])
    with pytest.raises(
        ConfigError, match="model.params.tiny: not a setting of MegatronBackendConfig"
    ):
        Trainer(cfg)
    # model.name=tiny-random itself is a model the Megatron backend builds
    # (experiment=megatron_smoke,
    # tests/trainer/test_megatron_run.py::test_megatron_smoke_experiment_then_convert_to_hf).


def _no_model_load(monkeypatch):
    """Fail the test if a backend is built: these checks must come before any model loads."""
    import nemo_d3s.trainer.loop as loop

    def refuse(cfg):
        raise AssertionError("a model was built before the check")

    monkeypatch.setattr(loop, "backend_from_config", refuse)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    _no_model_load(monkeypatch)
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "rollout=vllm"])
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine='vllm': vLLM is not installed in this Python; .*pip install",
    ):
        Trainer(cfg)
    r = cli(["experiment=smoke", f"output_dir={tmp_path}", "rollout=vllm"])
    assert r.returncode == 2 and "rollout.engine='vllm'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_device_without_a_gpu_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    cfg = compose(["experiment=smoke", f"output_dir={tmp_path}", "model.device=cuda"])
    why = "is a CPU-only build" if torch.version.cuda is None else "torch sees no GPU here"
    with pytest.raises(ConfigError, match=f"model.device='cuda': .*{why}"):
        Trainer(cfg)


def test_the_largest_accepted_seed_trains(tmp_path):
    # the bound validate() puts on `seed` is one every seeded RNG of a run accepts
    state, _ = run_inprocess(tmp_path, [*FAST, f"seed={2**32 - 1}"])
    assert state.step == 2


def test_tiny_random_export_names_its_architecture(tmp_path):
    """The converter and the Megatron backend refuse a config.json without `architectures`."""
    from nemo_d3s.formats.spec import ModelSpec

    run_inprocess(tmp_path, [*FAST, "trainer.steps=1", "trainer.export_hf=true"])
    cfg = json.loads((tmp_path / "hf_export" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert ModelSpec.from_hf_dict(cfg).num_layers >= 1


def test_a_gguf_path_is_read_as_a_gguf_file_not_reported_as_no_such_directory(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("NEMO_D3S_CACHE", str(tmp_path / "cache"))
    missing = tmp_path / "model.Q4_0.gguf"
    cfg = compose(
        [
            "experiment=smoke",
            f"output_dir={tmp_path / 'out'}",
            f"model.name={missing}",
            "~model.params.tiny",
        ]
    )
    with pytest.raises(FileNotFoundError, match=r"no such GGUF file") as e:
        Trainer(cfg)
    assert "no such directory" not in str(e.value)
    missing.write_bytes(b"GGUF" + bytes(60))  # a header and nothing else
    with pytest.raises(ConfigError, match=r"model\.Q4_0\.gguf': cannot convert this GGUF file"):
        Trainer(cfg)
    assert not list(
        (tmp_path / "cache").rglob("config.json")
    )  # nothing half-converted left in the cache


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    from nemo_d3s.backends.hf.gguf_convert import find_embedded_gguf
    from nemo_d3s.backends.hf.loading import resolve_model_path

    monkeypatch.setenv("NEMO_D3S_CACHE", str(tmp_path / "cache"))
    folder = resolve_model_path(str(find_embedded_gguf()))
    assert folder.parent == tmp_path / "cache" / "gguf" and (folder / "config.json").is_file()
    mtime = (folder / "config.json").stat().st_mtime_ns
    assert resolve_model_path(str(find_embedded_gguf())) == folder
    assert (folder / "config.json").stat().st_mtime_ns == mtime  # not converted again


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_a_model_folder_without_tokenizer_files_says_so(tmp_path):
    """transformers' own error asks to install sentencepiece."""
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    cfg = compose(
        [
            "experiment=smoke",
            f"output_dir={tmp_path / 'out'}",
            f"model.name={folder}",
            "~model.params.tiny",
        ]
    )
    with pytest.raises(
        FileNotFoundError, match=r"no_tokenizer' has no tokenizer file \(tokenizer.json"
    ) as e:
        Trainer(cfg)
    assert "sentencepiece" not in str(e.value)
    r = cli(
        [
            "experiment=smoke",
            f"output_dir={tmp_path / 'out2'}",
            f"model.name={folder}",
            "~model.params.tiny",
        ]
    )
    assert r.returncode == 2 and "has no tokenizer file" in r.stderr and "Traceback" not in r.stderr
