"""ParallelGroups: the device rule for small collectives, and its reductions on gloo ranks
(a plain gloo group and a device-mapped ``cpu:gloo,cuda:gloo`` one) against hand sums."""

from __future__ import annotations

import pytest
import torch

from _launch import run_ranks

from nemo_d3s.distributed.comm import collective_device
from nemo_d3s.distributed.groups import ParallelGroups, device_for_backend, shard_range


def test_device_rule(monkeypatch):
    # NCCL takes CUDA tensors only; a device-mapped backend with a CPU entry carries CPU
    # tensors itself, so counters stay on the host. No GPU needed: the rule is a mapping.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_for_backend("gloo") == torch.device("cpu")
    assert device_for_backend("nccl") == torch.device("cuda", 3)
    assert device_for_backend("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert device_for_backend("cuda:nccl") == torch.device("cuda", 3)
    assert device_for_backend("mpi") == torch.device("cpu")
    assert collective_device(None) == torch.device("cpu")


def test_one_process_record_is_the_identity():
    g = ParallelGroups()
    assert (g.dp_rank, g.dp_size, g.tp_size, g.pp_size, g.cp_size) == (0, 1, 1, 1, 1)
    assert g.is_main and not g.data_parallel
    assert g.sum({"a": 1.5, "b": 2}) == {"a": 1.5, "b": 2.0}
    assert g.max(3.0) == 3.0
    with pytest.raises(AttributeError):
        g.dp = None  # frozen: the layout does not change after the policy built it


def test_shard_range():
    assert [shard_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="evenly"):
        shard_range(6, 0, 4)


def _reductions(rank):
    import torch.distributed as dist

    out = {}
    for name, backend in (("gloo", "gloo"), ("mapped", "cpu:gloo,cuda:gloo")):
        group = dist.new_group([0, 1], backend=backend)
        g = ParallelGroups(dp=group, device=collective_device(group), global_rank=rank)
        out[name] = {
            "device": str(g.device),
            "sum": g.sum({"x": rank + 0.5, "y": 10.0 * rank}),
            "max": g.max(float(rank)),
            "dp": (g.dp_rank, g.dp_size),
        }
    return out


@pytest.mark.distributed
def test_reductions_on_two_ranks():
    results = run_ranks(_reductions, 2, megatron=False)
    for rank, res in enumerate(results):
        for name in ("gloo", "mapped"):
            r = res[name]
            assert r["device"] == "cpu", name
            assert r["sum"] == {"x": 2.0, "y": 10.0}
            assert r["max"] == 1.0
            assert r["dp"] == (rank, 2)


def _uneven_keys(rank):
    import torch.distributed as dist

    g = ParallelGroups(dp=dist.group.WORLD, global_rank=rank)
    return g.sum({"a": 1.0, "b": 2.0} if rank == 0 else {"a": 3.0}, keys_may_differ=True)


@pytest.mark.distributed
def test_sum_with_keys_that_differ_between_ranks():
    assert run_ranks(_uneven_keys, 2, megatron=False) == [{"a": 4.0, "b": 2.0}] * 2
