"""Context parallelism's chunking and gather: the zigzag positions against a hand-worked
case and the obvious definition; on 2 gloo ranks the gather restores global order and its
backward hands every position the gradient summed over the CP ranks."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from nemo_d3s.core.context_parallel import all_zigzag_positions, zigzag_positions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import run_ranks  # noqa: E402


def test_zigzag_hand_worked():
    # one row of 8 at CP 2: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(torch.tensor([0, 8]), 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(torch.tensor([0, 8]), 2, 1).tolist() == [2, 3, 4, 5]
    # two slots of 4 and 8: per slot, rank 0's first and last chunk
    assert zigzag_positions(torch.tensor([0, 4, 12]), 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    with pytest.raises(ValueError, match="multiple of 4"):
        zigzag_positions(torch.tensor([0, 6]), 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_zigzag_covers_every_position_once(cp):
    cu = torch.tensor([0, 6 * cp, 8 * cp, 18 * cp])
    every = all_zigzag_positions(cu, cp)
    assert sorted(every.tolist()) == list(range(int(cu[-1])))
    for r in range(cp):  # chunk r and 2 cp - 1 - r of each slot, equal halves
        pos = zigzag_positions(cu, cp, r)
        for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
            c = (hi - lo) // (2 * cp)
            mine = [p for p in pos.tolist() if lo <= p < hi]
            late = 2 * cp - 1 - r
            assert mine == [
                *range(lo + r * c, lo + (r + 1) * c),
                *range(lo + late * c, lo + (late + 1) * c),
            ]


def _rank(rank, cu):
    import torch.distributed as dist

    from nemo_d3s.distributed.context_parallel import ContextParallel

    cp = ContextParallel(dist.group.WORLD, torch.tensor(cu))
    full = torch.arange(2 * int(cu[-1]), dtype=torch.float32).view(2, -1)
    x = cp.local(full, 1).clone().requires_grad_(True)
    gathered = cp.gather(x, 1)
    weights = torch.arange(full.numel(), dtype=torch.float32).view_as(full)
    (gathered * weights).sum().backward()
    return gathered.detach(), x.grad, cp.local(weights, 1)


def test_gather_restores_order_and_sums_gradients():
    cu = [0, 4, 12]
    out = run_ranks(_rank, 2, cu, megatron=False)
    full = torch.arange(24, dtype=torch.float32).view(2, 12)
    for gathered, grad, local_w in out:
        assert torch.equal(gathered, full)
        # both ranks' losses reach this rank's positions: twice their weight
        assert torch.equal(grad, 2 * local_w)
