"""``nemo-d3s-selfcheck``: the result rules (a CUDA check is never passed without CUDA, a
failed check exits 1, ranks combine), the table and the JSON, the command in one process on
a few checks, and (slow) the whole CPU form end to end on spawned gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_d3s.selfcheck import cli
from nemo_d3s.selfcheck.base import Check
from nemo_d3s.selfcheck.report import (
    FAILED,
    NO_CUDA,
    NOT_RUN,
    PASSED,
    CheckFailed,
    CheckResult,
    NotRun,
    combine,
    exit_code,
    finalize,
    format_table,
    run_check,
    write_json,
)
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_run_check_maps_outcomes():
    assert run_check("a", False, lambda: {"x": 1.5}, cuda=False).status == PASSED
    r = run_check(
        "b", False, lambda: (_ for _ in ()).throw(NotRun("vLLM not installed")), cuda=False
    )
    assert (r.status, r.reason) == (NOT_RUN, "vLLM not installed")

    def out_of_bounds():
        raise CheckFailed("err=2 > 1", {"err": 2.0})

    r = run_check("c", False, out_of_bounds, cuda=False)
    assert (r.status, r.reason, r.measured) == (FAILED, "err=2 > 1", {"err": 2.0})
    r = run_check("d", False, lambda: 1 / 0, cuda=False)
    assert r.status == FAILED and r.reason.startswith("ZeroDivisionError")


def test_a_cuda_check_is_never_passed_without_cuda():
    called = []
    r = run_check("gpu.x", True, lambda: called.append(1) or {"t": 1.0}, cuda=False)
    assert (r.status, r.reason, called) == (NOT_RUN, NO_CUDA, [])
    # even a record that claims it passed (or failed) is overruled on a machine without CUDA
    claimed = [
        CheckResult("gpu.y", True, PASSED, measured={"t": 1.0}),
        CheckResult("gpu.z", True, FAILED, "x"),
        CheckResult("cpu.a", False, PASSED),
    ]
    got = finalize(claimed, cuda=False)
    assert [(r.status, r.reason) for r in got] == [
        (NOT_RUN, NO_CUDA),
        (NOT_RUN, NO_CUDA),
        (PASSED, ""),
    ]
    assert finalize(claimed, cuda=True)[0].status == PASSED


def test_ranks_combine_and_a_failure_exits_one():
    rank0 = [
        CheckResult("a", False, PASSED, rank=0),
        CheckResult("b", False, PASSED, rank=0),
        CheckResult("c", False, NOT_RUN, "one rank", rank=0),
    ]
    rank1 = [
        CheckResult("a", False, PASSED, rank=1),
        CheckResult("b", False, FAILED, "err=3", rank=1),
        CheckResult("c", False, NOT_RUN, "one rank", rank=1),
    ]
    got = combine([rank0, rank1])
    assert [(r.name, r.status, r.reason) for r in got] == [
        ("a", PASSED, ""),
        ("b", FAILED, "rank 1: err=3"),
        ("c", NOT_RUN, "one rank"),
    ]
    assert exit_code(got) == 1 and exit_code([got[0], got[2]]) == 0
    with pytest.raises(ValueError, match="other checks"):
        combine([rank0, rank1[:2]])


def test_table_and_json(tmp_path):
    results = [
        CheckResult(
            "env.versions", False, PASSED, measured={"torch": "2.13.0", "err": 1.234567e-6}
        ),
        CheckResult("gpu.vllm", True, NOT_RUN, NO_CUDA),
        CheckResult("gpt.local_spec", False, FAILED, "logprob_err=0.1 > 0.0001"),
    ]
    table = format_table(results)
    assert "env.versions" in table and "torch=2.13.0, err=1.23e-06" in table
    assert "not run: no CUDA" in table and "failed: logprob_err=0.1 > 0.0001" in table
    assert table.splitlines()[-1] == "1 passed, 1 failed, 1 not run"
    path = write_json(results, tmp_path / "out", {"world": 2})
    doc = json.loads(path.read_text())
    assert (
        path.name == "selfcheck.json" and doc["exit_code"] == 1 and doc["context"] == {"world": 2}
    )
    assert [c["status"] for c in doc["checks"]] == [PASSED, NOT_RUN, FAILED]
    assert doc["checks"][0]["measured"]["err"] == pytest.approx(1.234567e-6)


def _fails(ctx):
    raise CheckFailed("too far", {"err": 9.0})


def test_command_in_one_process_exits_one_on_a_failed_check(tmp_path, monkeypatch, capsys):
    """``main`` on one CPU rank with three checks: environment (real), a CUDA check (never
    called here) and one that fails: exit 1, the table printed, the JSON written."""
    from nemo_d3s.selfcheck import env_checks

    never = Check("gpu.never", True, lambda ctx: pytest.fail("a CUDA check ran without CUDA"))
    monkeypatch.setattr(
        cli,
        "all_checks",
        lambda: [*env_checks.CHECKS[:1], never, Check("demo.fails", False, _fails)],
    )
    monkeypatch.setattr(
        "torch.cuda.is_available", lambda: False
    )  # the CPU form wherever the test runs
    code = cli.main(["--out", str(tmp_path), "--ranks", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "failed: too far" in out and "not run: no CUDA" in out
    doc = json.loads((tmp_path / "selfcheck.json").read_text())
    assert [(c["name"], c["status"]) for c in doc["checks"]] == [
        ("env.versions", PASSED),
        ("gpu.never", NOT_RUN),
        ("demo.fails", FAILED),
    ]
    assert doc["context"]["mode"] == "one process" and not (tmp_path / ".selfcheck_work").exists()
    # and without the failing check: exit 0
    monkeypatch.setattr(cli, "all_checks", lambda: [*env_checks.CHECKS[:1], never])
    assert cli.main(["--out", str(tmp_path), "--ranks", "1"]) == 0


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["--model", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit):
        cli.main(["--ranks", "0"])


@pytest.mark.slow
@pytest.mark.distributed
def test_the_cpu_form_end_to_end(tmp_path):
    """``python -m nemo_d3s.selfcheck`` on this CPU machine: two spawned gloo ranks run every
    CPU check for real (all pass), every CUDA check says "not run: no CUDA", exit 0."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.selfcheck", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "selfcheck.json").read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["context"]["world"] == 2 and doc["exit_code"] == 0
    # (vllm.refit_buckets_shm: not run where vLLM is not installed; its test is in
    # tests/backends/test_vllm_engine.py)
    cpu = {n for n, c in checks.items() if not c["needs_cuda"] and not n.startswith("vllm.")}
    assert cpu == {
        "env.versions",
        "collectives.gloo",
        "cluster.gloo_across_nodes",
        "vocab_parallel.fp32_gloo",
        "gpt.local_spec",
        "gpt.long_sequence",
        "gpt.packed_cp",
        "moe.local_spec",
        "moe.router_replay",
        "gpt.pp_recompute",
        "gpt.interleaved_pipeline",
        "rl.megatron_step",
        "checkpoint.roundtrip",
        "refit.staged_tp_pp",
    }
    assert all(checks[n]["status"] == PASSED for n in cpu), {n: checks[n]["reason"] for n in cpu}
    assert all(
        (c["status"], c["reason"]) == (NOT_RUN, NO_CUDA) for c in checks.values() if c["needs_cuda"]
    )
    assert len(checks) - len(cpu) >= 7
    assert checks["gpt.local_spec"]["measured"]["layouts"] == ["tp2pp1", "tp1pp2"]
    assert checks["gpt.local_spec"]["measured"]["logprob_err"] <= 1e-4
    assert checks["checkpoint.roundtrip"]["measured"]["loaded_at_tp"] == [2, 1]
    # the tiny model's 2 layers leave out PP2 x VPP2 (it needs 4)
    assert checks["gpt.long_sequence"]["measured"]["layouts"] == ["tp2_sp", "pp2_tokens"]
    assert checks["gpt.long_sequence"]["measured"]["weights_err"] <= 1e-5
    assert checks["gpt.packed_cp"]["measured"]["layouts"] == ["packed", "cp2", "cp2_packed"]
    assert checks["gpt.packed_cp"]["measured"]["logprob_err"] <= 1e-4
    assert checks["moe.local_spec"]["measured"]["dispatchers"] == ["alltoall", "allgather"]
    assert checks["moe.local_spec"]["measured"]["weights_err"] <= 1e-5
    gloo = checks["cluster.gloo_across_nodes"]["measured"]
    assert gloo["ranks"] == 2 and gloo["hosts"] == 1 and gloo["across_nodes"] is False
    assert "14 passed, 0 failed" in proc.stdout


# ---------------------------------------------------------------- the CUDA checks' logic on the CPU
def _ctx(tmp_path, **cache):
    import torch

    from nemo_d3s.selfcheck.base import Context

    return Context(
        rank=0,
        world=2,
        local_rank=0,
        cuda=True,
        device=torch.device("cpu"),
        model_dir=tmp_path / "m",
        tiny=True,
        work_dir=tmp_path,
        cache=dict(cache),
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from nemo_d3s.selfcheck.base import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("selfcheck") / "m")


def test_peak_memory_is_compared_with_the_dry_runs_plan(tmp_path, tiny_dir):
    """gpu.peak_memory: the dry run's plan for the self-check's own RL config (built here on
    the meta device), against a measured peak: below it passes with the ratio, above fails."""
    from nemo_d3s.selfcheck.gpu_checks import check_peak_memory
    from nemo_d3s.selfcheck.rl_checks import rl_overrides
    from nemo_d3s.train import compose_config

    ctx = _ctx(tmp_path)
    ctx.model_dir = tiny_dir
    cfg = compose_config(rl_overrides(ctx, str(tmp_path / "rl")))
    ctx.cache["rl"] = {"cfg": cfg, "peak_reserved_bytes": 2**29}
    out = check_peak_memory(ctx)
    assert 0 < out["ratio"] < 1 and out["predicted_gib"] > out["measured_gib"] == 0.5
    ctx.cache["rl"]["peak_reserved_bytes"] = 2**40
    with pytest.raises(CheckFailed, match="ratio="):
        check_peak_memory(ctx)


def test_without_transformer_engine_the_rl_run_takes_the_local_spec_and_says_so(
    tmp_path, tiny_dir, monkeypatch
):
    """On the first GPU run (an H200 without TE) the missing library failed the TE checks and
    then, through the default spec, the RL run and the checkpoint round trip too. Now: on CUDA
    without TE those two take the local spec and name the reason; with TE (or on CPU) the
    default stays."""
    from nemo_d3s.backends.megatron import model as mmodel
    from nemo_d3s.selfcheck.base import run_transformer_impl
    from nemo_d3s.selfcheck.rl_checks import rl_overrides
    from nemo_d3s.train import compose_config

    ctx = _ctx(tmp_path)
    ctx.model_dir = tiny_dir
    monkeypatch.setattr(
        mmodel, "transformer_engine_error", lambda: "import transformer_engine.pytorch failed: X"
    )
    impl, why = run_transformer_impl(ctx)
    assert impl == "local" and "Transformer Engine absent" in why
    cfg = compose_config(rl_overrides(ctx, str(tmp_path / "rl")))
    assert cfg.model.params.transformer_impl == "local"
    monkeypatch.setattr(mmodel, "transformer_engine_error", lambda: None)
    assert run_transformer_impl(ctx) == ("transformer_engine", None)
    cfg = compose_config(rl_overrides(ctx, str(tmp_path / "rl")))
    assert cfg.model.params.transformer_impl == "transformer_engine"
    monkeypatch.setattr(mmodel, "transformer_engine_error", lambda: "absent")
    ctx.cuda = False
    assert run_transformer_impl(ctx) == ("transformer_engine", None)


def test_an_rl_run_without_an_update_says_when_every_reward_was_equal(tmp_path, monkeypatch):
    """rl.megatron_step on a model that earns one reward everywhere (random weights at a real
    width, seen on an H200): the failure says why there was no optimizer step."""
    from nemo_d3s.selfcheck import rl_checks
    from nemo_d3s.trainer import checkpoint

    ctx = _ctx(tmp_path)
    last = {"optimizer_steps": 0, "skip_all_equal": 1.0, "skipped": 1.0}
    monkeypatch.setattr(rl_checks, "run_rl", lambda c, name: {"last": dict(last), "rows": 2})
    monkeypatch.setattr(checkpoint, "checkpoint_dirs", lambda folder: [tmp_path / "step_2"])
    monkeypatch.setattr(checkpoint, "verify_checkpoint", lambda folder, shared: None)
    with pytest.raises(CheckFailed, match="every group's rewards were equal"):
        rl_checks.check_rl_step(ctx)
    last.pop("skip_all_equal")
    with pytest.raises(CheckFailed, match="no optimizer step was taken$"):
        rl_checks.check_rl_step(ctx)
    last["skipped_nonfinite"] = 1.0  # once counted as a step, with grad_norm inf
    with pytest.raises(CheckFailed, match="taken: the gradient norm was not finite$"):
        rl_checks.check_rl_step(ctx)


@pytest.mark.parametrize("gpu,total_mib", [("H100 80GB", 81559), ("H200 141GB", 143771)])
def test_the_vllm_memory_gate_passes_its_own_check_on_80_and_141_gb_gpus(
    gpu, total_mib, tmp_path, tiny_dir
):
    """vllm.memory on described GPUs (CUDA's total = NVML's figure): an engine taking what
    vLLM 0.33 takes there, ceil(total x utilization) (v1/worker/utils.py:716-726) plus a
    worker context of 0.55 GB made before that budget is measured, passes; the gate's old
    prediction (utilization x trainer.gpu_memory_gb's 80 GB) fails it on both GPUs, and an
    engine holding twice its share fails."""
    import math

    from nemo_d3s.selfcheck.rl_checks import rl_overrides
    from nemo_d3s.selfcheck.vllm_checks import (
        ENGINE_MEMORY_TOLERANCE,
        ENGINE_MEMORY_UTILIZATION,
        judge_engine_memory,
    )

    ctx = _ctx(tmp_path)
    ctx.model_dir = tiny_dir
    gmu = ENGINE_MEMORY_UTILIZATION
    overrides = rl_overrides(
        ctx, str(tmp_path / "m"), extra=["rollout=vllm", f"rollout.gpu_memory_utilization={gmu}"]
    )
    total = total_mib * 2**20
    taken = math.ceil(total * gmu) + 0.55e9
    out = judge_engine_memory(overrides, ctx.world, total, taken)
    assert 1 - ENGINE_MEMORY_TOLERANCE <= out["ratio"] <= 1 + ENGINE_MEMORY_TOLERANCE, out
    assert out["gpu_total_gib"] == total_mib / 1024
    assert taken / (gmu * 80e9) > 1 + ENGINE_MEMORY_TOLERANCE  # what the gate compared with
    with pytest.raises(CheckFailed, match="ratio="):
        judge_engine_memory(overrides, ctx.world, total, 2 * taken)


def test_a_gloo_group_that_does_not_connect_names_gloo_socket_ifname(tmp_path, monkeypatch):
    """cluster.gloo_across_nodes where gloo cannot connect across the nodes (its interface is
    not one they reach each other on): the check fails naming GLOO_SOCKET_IFNAME."""
    from nemo_d3s.selfcheck import comm_checks

    def no_route(ctx, backend):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] connect: No route")

    monkeypatch.setattr(comm_checks, "_group", no_route)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "docker0")
    check = next(c for c in comm_checks.CHECKS if c.name == "cluster.gloo_across_nodes")
    with pytest.raises(CheckFailed, match="GLOO_SOCKET_IFNAME=docker0: set it to the interface"):
        check.fn(_ctx(tmp_path))


def test_cuda_checks_that_need_the_rl_run_say_why_they_did_not_run(tmp_path):
    from nemo_d3s.selfcheck.gpu_checks import check_peak_memory, check_step_time

    for fn in (check_peak_memory, check_step_time):
        with pytest.raises(NotRun, match="rl.megatron_step did not complete"):
            fn(_ctx(tmp_path))
    assert check_step_time(_ctx(tmp_path, rl={"last": {"time_step": 2.5}}))["time_step_s"] == 2.5


def test_vllm_check_bounds_the_logprob_gap(tmp_path, monkeypatch):
    import importlib.util

    from nemo_d3s.selfcheck import gpu_checks

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a),
    )
    rows = {"last": {"optimizer_steps": 2, "rollout_logprob_mismatch_abs": 0.01}, "rows": 2}
    monkeypatch.setattr(gpu_checks, "run_rl", lambda ctx, name, extra: rows)
    assert gpu_checks.check_vllm(_ctx(tmp_path))["logprob_mismatch_abs"] == 0.01
    rows["last"]["rollout_logprob_mismatch_abs"] = 0.5
    with pytest.raises(CheckFailed, match="logprob_mismatch_abs=0.5 > 0.05"):
        gpu_checks.check_vllm(_ctx(tmp_path))
    rows["last"]["optimizer_steps"] = 1
    with pytest.raises(CheckFailed, match="two optimizer steps"):
        gpu_checks.check_vllm(_ctx(tmp_path))


def test_te_check_fails_naming_a_broken_transformer_engine(tmp_path, monkeypatch):
    from nemo_d3s.selfcheck.model_checks import check_te_spec

    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(
        CheckFailed, match="Transformer Engine: import transformer_engine.pytorch failed"
    ):
        check_te_spec(_ctx(tmp_path))


# ------------------------------------------------------ issue 30: the 70B set-up, the cluster
def test_cluster_preconditions_decide_by_hand():
    from nemo_d3s.selfcheck.cluster_checks import compute_mode_problem, cuda_version, driver_problem

    assert compute_mode_problem("Default") is None
    assert "Exclusive_Process" in compute_mode_problem(" Exclusive_Process")
    assert compute_mode_problem("Prohibited") is not None
    assert cuda_version(12040) == (12, 4) and cuda_version(13000) == (13, 0)
    assert driver_problem(12080, "12.8") == (None, None)
    assert driver_problem(13000, "12.8") == (None, None)
    fail, note = driver_problem(12020, "12.8")  # same major, older minor: runs, noted
    assert fail is None and "minor-version compatibility" in note
    fail, note = driver_problem(11080, "12.1")
    assert "CUDA 11.8" in fail and note is None


def test_cuda_checks_say_what_they_would_check_without_cuda(tmp_path, monkeypatch, capsys):
    from nemo_d3s.selfcheck import cluster_checks, pipeline_checks

    cuda_checks = [c for c in (*cluster_checks.CHECKS, *pipeline_checks.CHECKS) if c.needs_cuda]
    assert {c.name for c in cuda_checks} == {
        "cluster.shared_gpu",
        "cluster.driver",
        "gpt.te_spec_pp_recompute",
        "gpt.te_spec_interleaved",
        "gpt.bf16_plain_adamw",
    }
    assert all(c.what for c in cuda_checks)
    monkeypatch.setattr(cli, "all_checks", lambda: cuda_checks)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["--out", str(tmp_path), "--ranks", "1"]) == 0
    assert capsys.readouterr().out.count("not run: no CUDA") == 5
    doc = json.loads((tmp_path / "selfcheck.json").read_text())
    for c, rec in zip(cuda_checks, doc["checks"]):
        assert (rec["status"], rec["reason"]) == (NOT_RUN, NO_CUDA)
        assert rec["measured"] == {"would_check": c.what}


@pytest.mark.distributed
def test_the_cpu_twins_of_the_70b_pipeline_paths_pass_on_gloo(tmp_path, monkeypatch):
    """gpt.pp_recompute (PP2, full recompute) and gpt.interleaved_pipeline (PP2 x VPP2 on the
    tiny model built with 4 layers) against TP1 x PP1 on 2 spawned gloo ranks."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code = cli.main(
        [
            "--out",
            str(tmp_path),
            "--ranks",
            "2",
            "--only",
            "gpt.pp_recompute,gpt.interleaved_pipeline",
        ]
    )
    doc = json.loads((tmp_path / "selfcheck.json").read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert code == 0 and set(checks) == {"gpt.pp_recompute", "gpt.interleaved_pipeline"}
    assert all(c["status"] == PASSED for c in checks.values()), checks
    assert checks["gpt.pp_recompute"]["measured"]["layouts"] == ["tp1pp2_recompute"]
    inter = checks["gpt.interleaved_pipeline"]["measured"]
    assert inter["layers"] == 4 and inter["layouts"] == ["pp2_vpp2"]
    assert inter["logprob_err"] <= 1e-4 and inter["weights_err"] <= 1e-5


def test_the_cpu_twin_of_the_moe_path_passes_on_gloo(tmp_path, monkeypatch):
    """moe.local_spec: a tiny Qwen3-MoE at EP 2 (both dispatchers) against EP 1 on 2
    spawned gloo ranks; moe.router_replay: its routing recorded and replayed at EP 2; the CUDA
    twin (TE grouped GEMM, all-to-all over NCCL) says why not."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    only = "moe.local_spec,moe.router_replay,moe.te_grouped_gemm"
    code = cli.main(["--out", str(tmp_path), "--ranks", "2", "--only", only])
    doc = json.loads((tmp_path / "selfcheck.json").read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert code == 0 and checks["moe.local_spec"]["status"] == PASSED, checks
    m = checks["moe.local_spec"]["measured"]
    assert m["dispatchers"] == ["alltoall", "allgather"] and m["weights_err"] <= 1e-5
    r = checks["moe.router_replay"]
    assert r["status"] == PASSED and r["measured"]["ep"] == 2, r
    assert r["measured"]["own_replay_logprob_err"] <= 1e-6
    assert r["measured"]["other_replay_logprob_change"] > 1e-3
    assert (checks["moe.te_grouped_gemm"]["status"], checks["moe.te_grouped_gemm"]["reason"]) == (
        NOT_RUN,
        NO_CUDA,
    )
