"""Where the ranks of a model-parallel group wait for its rollout engine
(``MegatronBackend._mp_gloo_group``): on a gloo twin of the group, created by every rank for
every group, so the waits (rollouts broadcast, refit barriers) run on the host, never inside
an NCCL collective spinning on the GPUs vLLM generates on. On CUDA the model-parallel group
is NCCL; here the world is gloo and the NCCL backend is reported by a patch."""

from __future__ import annotations

import pytest

from nemo_d3s.distributed import run_on_gloo_ranks

pytestmark = pytest.mark.distributed


def _body(rank: int):
    import types

    import torch.distributed as dist

    from nemo_d3s.backends.megatron.backend import MegatronBackend

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    real_backend = dist.get_backend
    dist.get_backend = lambda g=None: "nccl" if g is mine else real_backend(g)  # as on CUDA
    try:
        stub = types.SimpleNamespace(_mp_gloo=None, _mp_group=lambda: (mine, 2 * (rank // 2)))
        group = MegatronBackend._mp_gloo_group(stub)
        again = MegatronBackend._mp_gloo_group(stub)
    finally:
        dist.get_backend = real_backend
    box = [f"rollouts of {rank}" if rank % 2 == 0 else None]
    dist.broadcast_object_list(box, src=2 * (rank // 2), group=group)
    return {
        "backend": str(real_backend(group)),
        "ranks": dist.get_process_group_ranks(group),
        "same": group is again,
        "got": box[0],
        "new": group is not mine,
    }


def test_the_engine_group_waits_on_a_gloo_twin_of_the_model_parallel_group():
    res = run_on_gloo_ranks(_body, 4, timeout=120)
    for r, x in enumerate(res):
        assert x["backend"] == "gloo" and x["new"] and x["same"]
        assert x["ranks"] == ([0, 1] if r < 2 else [2, 3])
        assert x["got"] == f"rollouts of {2 * (r // 2)}"
