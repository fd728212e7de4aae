"""Generation overlapped with training through the whole trainer (``rollout.max_staleness``):
the smoke run trains with staleness 1 from its second step and never more; its first step
(version 0's rollouts, sampled from the engine's own copy of the weights) is the synchronous
run's; a 2-rank run at k = 1 is the 1-process run at k = 1 on the HF backend (data parallel)
and on the Megatron backend (TP 2, the engine's model-parallel group on gloo); kill -9, or a
stop signal while the worker generates, then resume=true ends with the uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from nemo_d3s.trainer.metrics import is_timing_key, read_jsonl

from .conftest import REPO, cli, cli_env, run_inprocess, without_timing
from _limits import WAIT_S  # noqa: E402
from .test_distributed import RUN, _assert_same_run, _assert_same_weights, _compare

# what only an off-policy run logs: the staleness and the behaviour policy's log-probs
PIPELINE_KEYS = ("rollout_staleness", "rollout_logprob_mismatch", "is_ratio_")


def test_smoke_run_at_k1_trains_one_step_stale_and_starts_as_the_synchronous_run(tmp_path):
    _, sync = run_inprocess(tmp_path / "k0", ["trainer.save_every=0", "trainer.export_hf=false"])
    _, rows = run_inprocess(
        tmp_path / "k1",
        ["rollout.max_staleness=1", "trainer.save_every=0", "trainer.export_hf=false"],
    )
    staleness = [r["rollout_staleness"] for r in rows]
    assert staleness == [0.0] + [1.0] * (len(rows) - 1) and max(staleness) <= 1
    assert all("rollout_staleness" not in r for r in sync)  # k = 0 logs what it logged before
    assert all(r["time_generation"] == r["time_rollout"] for r in sync)  # inside the step
    for r in rows:
        assert 0.0 <= r["time_overlap_share"] <= 1.0 and r["time_wait_for_rollouts"] >= 0.0
    first = {
        k: v for k, v in rows[0].items() if not is_timing_key(k) and not k.startswith(PIPELINE_KEYS)
    }
    assert first == {k: v for k, v in sync[0].items() if not is_timing_key(k)}
    assert rows[0]["optimizer_steps"] > 0, "step 0 trained nothing: the comparison is vacuous"
    # the sampler's behaviour log-probs, token-aligned: at step 0 (same weights) they are the
    # trainer's to float noise; one step stale they are not
    assert rows[0]["rollout_logprob_mismatch_kl"] < 1e-8
    assert rows[0]["is_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert rows[1]["rollout_logprob_mismatch_kl"] > 1e-4
    assert rows[1]["is_ratio_min"] < rows[1]["is_ratio_p50"] < rows[1]["is_ratio_max"]
    evals = [read_jsonl(tmp_path / d / "eval.jsonl") for d in ("k0", "k1")]
    assert [e["step"] for e in evals[1]] == [e["step"] for e in evals[0]]
    assert without_time(evals[1][0]) == without_time(evals[0][0])  # step 0: same weights


def test_masked_importance_sampling_drops_stale_tokens_from_the_update(tmp_path):
    """A cap this tight (ratios outside [1/1.01, 1.01] dropped) leaves out most tokens of a
    one-step-stale batch: the update trains on fewer tokens than were selected."""
    over = ["rollout.max_staleness=1", "algorithm.tis_cap=1.01", "algorithm.is_correction=mask"]
    _, rows = run_inprocess(tmp_path / "mask", [*over, "trainer.save_every=0"])
    stale = [r for r in rows if r["rollout_staleness"] == 1 and not r.get("skip_all_equal")]
    assert stale and all(r["is_masked_share"] > 0 for r in stale)
    assert any(r["update_tokens"] < r["n_kept_tokens"] for r in stale)


def test_pods_regime_generates_n_trains_m_and_reports_both_budgets(tmp_path):
    """trainer.num_generations=8 rollouts per prompt, PODS keeps 2 (d3s.schedule.n_*), the
    generation beside the update (k = 1): each row says what was generated and trained and
    the seconds of each; train.log says it on the step's line."""
    over = ["d3s=pods", "trainer.num_generations=8", "d3s.schedule.n_init=2"]
    over += ["d3s.schedule.n_final=2", "rollout.max_staleness=1", "trainer.steps=2"]
    _, rows = run_inprocess(tmp_path, [*over, "trainer.save_every=0", "trainer.export_hf=false"])
    for r in rows:
        assert (r["n_samples"], r["n_kept_samples"]) == (4 * 8, 4 * 2)
        assert r["time_generation"] > 0 and r["time_training"] > 0
    log = (tmp_path / "train.log").read_text()
    assert "step 2: " in log and "(generated 32 in " in log and ", trained 8 in " in log


def without_time(row):
    return {k: v for k, v in row.items() if not is_timing_key(k)}


@pytest.mark.slow  # a whole program run (or several): the slow tier
@pytest.mark.distributed
def test_two_ranks_at_k1_match_one_process_at_k1(tmp_path):
    _compare(tmp_path, [("async", ["d3s=d3s"])], extra=["rollout.max_staleness=1"])
    rows = read_jsonl(tmp_path / "two_async" / "metrics.jsonl")
    assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tp,nproc", [(2, 2), (1, 2)], ids=["tp2", "tp1dp2"])
def test_megatron_at_k1_matches_the_hf_backend_at_k1(tmp_path, tp, nproc):
    sys.path.insert(0, str(REPO / "tests" / "backends" / "megatron"))
    from _tiny_hf import make_tiny_hf

    from .test_megatron_run import _finish, _megatron, _torchrun

    folder = str(make_tiny_hf(tmp_path / "llama", "llama", tied=False))
    run = [*RUN, "experiment=smoke", "rollout.max_staleness=1", f"model.name={folder}"]
    run += ["~model.params.tiny", "trainer.export_hf=true"]
    run_inprocess(tmp_path / "hf", run)
    out = tmp_path / "megatron"
    _finish(_torchrun(nproc, [*run, *_megatron(tp, 1), f"output_dir={out}"]))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert any(r["optimizer_steps"] > 0 for r in rows)
    _assert_same_run(read_jsonl(tmp_path / "hf" / "metrics.jsonl"), rows, f"tp{tp} k1")
    _assert_same_weights(tmp_path / "hf", out, f"tp{tp} k1")


# test_resume's run at k = 1: 8 steps, a checkpoint every 2, evaluations at 4 and 8
ASYNC = ["experiment=smoke", "trainer.steps=8", "trainer.save_every=2", "trainer.eval_every=4"]
ASYNC += ["trainer.max_new_tokens=16", "trainer.keep_last=2", "rollout.max_staleness=1"]


def _same_records(ref, run):
    for name in ("metrics.jsonl", "eval.jsonl"):
        got, want = read_jsonl(run / name), read_jsonl(ref / name)
        assert without_timing(got) == without_timing(want), name
    assert len(read_jsonl(run / "metrics.jsonl")) == 8


@pytest.mark.slow  # a whole program run (or several): the slow tier
def test_kill_9_of_an_async_run_then_resume_ends_with_the_uninterrupted_run(tmp_path):
    from .test_resume import _popen, _wait_for

    ref, run = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref, ASYNC[1:])
    proc = _popen([*ASYNC, f"output_dir={run}"], tmp_path / "killed.log")
    _wait_for(run / "checkpoints" / "step_000002" / "trainer_state.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "step_000008").exists(), "killed too late to test anything"
    assert (run / "checkpoints" / "step_000002" / "rollouts_rank0.safetensors").is_file()
    r = cli([*ASYNC, f"output_dir={run}", "resume=true"], timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "differ from an uninterrupted run" not in r.stdout + r.stderr
    _same_records(ref, run)


@pytest.mark.slow  # a whole program run (or several): the slow tier
def test_a_stop_signal_while_the_worker_generates_then_resume_ends_with_the_uninterrupted_run(
    tmp_path,
):
    """SIGTERM as the worker starts the batch of step 3 (fault point pipeline.generate, the
    4th batch) while step 2 trains: the run stops without waiting for that generation,
    checkpoints the last finished update and exits 75; the batch it cut short is generated
    on resume from the engine weights the checkpoint kept (or was finished and kept)."""
    from nemo_d3s.train import EXIT_INTERRUPTED

    ref, run = tmp_path / "ref", tmp_path / "run"
    run_inprocess(ref, ASYNC[1:])
    env = dict(cli_env(), NEMO_D3S_FAULT="pipeline.generate@4=term")
    r = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *ASYNC, f"output_dir={run}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == EXIT_INTERRUPTED, r.stderr[-3000:]
    step = json.loads((run / "interrupted.json").read_text())["step"]
    assert 2 <= step <= 3, step
    r = cli([*ASYNC, f"output_dir={run}", "resume=true"], timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "differ from an uninterrupted run" not in r.stdout + r.stderr
    _same_records(ref, run)
