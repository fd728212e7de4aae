"""``cpu_compat_moe``: megatron-core's MoE modules on CPU / gloo ranks, checked inside gloo
ranks so the patches never reach the pytest process. The proxy's ``torch.distributed``
gathers and reduce-scatters lists of unequal sizes as NCCL does (against an obvious
per-rank reference), the router's gating matmul runs without Transformer Engine in fp32,
and the dispatcher's split sizes come back as host arrays."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "distributed")
)
from _launch import run_ranks  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed


def _rank_uneven(rank):
    import torch.distributed as dist

    from nemo_d3s.backends.megatron.cpu_compat_moe import CpuDistributed

    world = dist.get_world_size()
    rows = [r + 2 for r in range(world)]  # rank r holds r + 2 rows
    mine = torch.arange(rows[rank] * 3, dtype=torch.float32).view(-1, 3) + 100 * rank
    gathered = [torch.empty(n, 3) for n in rows]
    CpuDistributed.all_gather(gathered, mine)
    # reduce-scatter: every rank contributes sum(rows) rows; rank r keeps its rows[r] summed
    full = torch.arange(sum(rows) * 3, dtype=torch.float32).view(-1, 3) * (rank + 1)
    out = torch.empty(rows[rank], 3)
    CpuDistributed.reduce_scatter(out, list(full.split(rows)))
    return {"gathered": gathered, "scattered": out, "rows": rows}


def test_uneven_gather_and_scatter_match_nccls_meaning():
    results = run_ranks(_rank_uneven, 3, megatron=False, timeout=WAIT_S)
    rows = results[0]["rows"]
    want = [
        torch.arange(n * 3, dtype=torch.float32).view(-1, 3) + 100 * r for r, n in enumerate(rows)
    ]
    base = torch.arange(sum(rows) * 3, dtype=torch.float32).view(-1, 3)
    total = sum(base * (r + 1) for r in range(len(rows)))
    for rank, res in enumerate(results):
        assert all(torch.equal(g, w) for g, w in zip(res["gathered"], want))
        assert torch.equal(res["scattered"], total.split(rows)[rank])


def _rank_router(rank):
    from nemo_d3s.backends.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    out.sum().backward()
    split = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    kept = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]))
    return {
        "out_err": float((out - x @ w.t()).abs().max()),
        "grad_err": float((x.grad - torch.ones(5, 4) @ w).abs().max()),
        "split": type(split).__name__,
        "kept": type(kept).__name__,
    }


def test_router_gemm_without_te_and_host_split_sizes():
    (res,) = run_ranks(_rank_router, 1, megatron=False, timeout=WAIT_S)
    assert res["out_err"] < 1e-5 and res["grad_err"] < 1e-5
    assert (res["split"], res["kept"]) == ("ndarray", "Tensor")
