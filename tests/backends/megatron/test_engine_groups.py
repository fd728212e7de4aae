"""The groups a Megatron run creates (issue 30, item 3).

- Where the ranks of a model-parallel group wait for its rollout engine
  (``MegatronBackend.mp_gloo_group``): on a gloo twin of the group, so the waits (rollouts
  broadcast, refit barriers) run on the host, never inside an NCCL collective spinning on
  the GPUs vLLM generates on. The twin is made with Megatron's groups
  (``parallel.make_model_parallel_gloo_twin``), from the layout alone: no collective on the
  world group (on CUDA that was an NCCL all-gather, made while the engine's rank was
  still building vLLM). Here any world collective while the twin is asked for fails.
- Every group the run creates waits ``trainer.dist_timeout_minutes``: Megatron's groups,
  the gloo ones Megatron makes without a timeout, the twin. Read back from each group's
  backend options (``distributed.timeouts.group_timeout``; torch 2.13
  ``_C/_distributed_c10d.pyi:316-323`` ``Backend.Options._timeout``).

Layout: TP1 x PP2 x DP2 in Megatron's default order (global rank = d + 2 p), so the
model-parallel groups are {0, 2} and {1, 3}: not consecutive ranks.
"""

from __future__ import annotations

import pytest

from nemo_d3s.distributed import run_on_gloo_ranks
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

MINUTES = 7.0


def _body(rank: int):
    import types

    import torch
    import torch.distributed as dist

    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.prepare import init_groups
    from nemo_d3s.distributed.timeouts import group_timeout, groups_of_this_process

    cfg = types.SimpleNamespace(dist_timeout_minutes=MINUTES, use_tp_pp_dp_mapping=False)
    groups = init_groups(cfg, torch.device("cpu"), 1, 2, 1)
    stub = types.SimpleNamespace()

    def refuse(*a, **k):
        raise AssertionError("a collective while the gloo twin was asked for")

    saved = {n: getattr(dist, n) for n in ("all_gather_object", "all_gather", "broadcast")}
    for n in saved:
        setattr(dist, n, refuse)
    try:
        twin = MegatronBackend.mp_gloo_group(stub)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    from megatron.core import parallel_state as ps

    src = dist.get_global_rank(twin, 0)
    box = [f"rollouts of {rank}" if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=twin)
    timeouts = sorted(
        {t.total_seconds() for g in groups_of_this_process() for t in group_timeout(g).values()}
    )
    out = {
        "backend": str(dist.get_backend(twin)),
        "ranks": dist.get_process_group_ranks(twin),
        "megatron": sorted(dist.get_process_group_ranks(ps.get_model_parallel_group())),
        "got": box[0],
        "timeouts": timeouts,
        "n_groups": len(groups_of_this_process()),
        "pp": groups.pp is not None,
    }
    ps.destroy_model_parallel()
    return out


def test_every_group_takes_the_configured_timeout_and_the_twin_needs_no_collective():
    res = run_on_gloo_ranks(_body, 4, timeout=WAIT_S)
    for r, x in enumerate(res):
        assert x["backend"] == "gloo" and x["pp"]
        assert x["ranks"] == x["megatron"] == ([0, 2] if r % 2 == 0 else [1, 3])
        assert x["got"] == f"rollouts of {r % 2}"
        assert x["n_groups"] > 10  # Megatron's groups, their gloo twins, ours
        assert x["timeouts"] == [MINUTES * 60.0]


def test_one_process_per_model_copy_has_no_group_to_wait_for():
    """TP = PP = 1 (DP only): the model-parallel group is None, and the engine wrapper asked
    that None for its timeouts (an AttributeError at start-up of every such Megatron run)."""
    from nemo_d3s.backends.megatron.engine import ModelParallelRollouts

    rollouts = ModelParallelRollouts(None, None, None, 0, prompt_seeds=True)
    assert rollouts.wait is None and rollouts.is_src
