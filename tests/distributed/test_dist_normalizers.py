"""Global loss denominators (DP x CP) and the per-micro-batch loss scale.

The gradient-level check (Megatron TP layers, real schedule, DDP averaging) is in
test_dist_megatron_grads.py; here: the counts themselves under context parallelism, where
each CP rank holds a slice of every sequence (Megatron's load-balanced split: 2 x CP chunks,
rank c takes chunks c and 2 CP - 1 - c), so tokens are summed over CP but a sequence is
counted once, and the scale arithmetic worked by hand.
"""

from __future__ import annotations

import pytest
import torch

from _launch import run_ranks

pytestmark = pytest.mark.distributed

CP, S = 2, 8


def _full_masks(dp_rank):
    g = torch.Generator().manual_seed(dp_rank)
    loss_mask = torch.rand(3 + dp_rank, S, generator=g) < 0.3
    loss_mask[0] = False
    loss_mask[0, 1] = True  # this row has a token in CP rank 0's slice only
    loss_mask[1] = False  # a row with nothing kept
    norm_mask = loss_mask | (torch.rand(loss_mask.shape, generator=g) < 0.5)
    return loss_mask, norm_mask


def _cp_columns(cp_rank):
    chunk = S // (2 * CP)
    cols = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
    j = 2 * CP - 1 - cp_rank
    return cols + list(range(j * chunk, (j + 1) * chunk))


def _rank_denoms(rank):
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed import global_loss_denominator, step_normalizer

    dp, cp = ps.get_data_parallel_group(), ps.get_context_parallel_group()
    assert ps.get_context_parallel_world_size() == CP and ps.get_data_parallel_world_size() == 2
    loss_mask, norm_mask = _full_masks(ps.get_data_parallel_rank())
    cols = _cp_columns(ps.get_context_parallel_rank())
    lm, nm = loss_mask[:, cols], norm_mask[:, cols]
    halves = [lm[:2], lm[2:]]  # two micro-batches
    out = {}
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        out[agg] = global_loss_denominator(halves, agg, dp, cp_group=cp)
        out[agg, "norm"] = global_loss_denominator(lm, agg, dp, cp_group=cp, norm_masks=nm)
    out["normalizer"] = step_normalizer(
        halves, "token_mean", dp, cp_group=cp, num_microbatches=2
    ).loss_scale
    return out


def test_context_parallel_counts_each_sequence_once():
    from nemo_d3s.core.losses import loss_denominator

    results = run_ranks(_rank_denoms, 4, cp=CP)
    full = [_full_masks(d) for d in range(2)]
    lm = torch.cat([f[0] for f in full])
    nm = torch.cat([f[1] for f in full])
    for out in results:
        for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
            assert out[agg] == loss_denominator(lm, agg)
            assert out[agg, "norm"] == loss_denominator(lm, agg, norm_mask=nm)
        assert out["normalizer"] == pytest.approx(2 * 2 / loss_denominator(lm, "token_mean"))


def test_step_normalizer_arithmetic():
    from nemo_d3s.distributed import StepNormalizer, global_loss_denominator

    # D = 10 global tokens, 2 DP ranks, 3 micro-batches on this rank: the schedule divides
    # each loss by 3 and DDP averages over 2 ranks, so each micro-batch sum is scaled by
    # 2 x 3 / 10 = 0.6 (plain summing loop: 2 / 10).
    n = StepNormalizer(10.0, dp_size=2, num_microbatches=3)
    assert n.loss_scale == pytest.approx(0.6)
    assert float(n.scale(torch.tensor(5.0))) == pytest.approx(3.0)
    assert StepNormalizer(10.0, 2, 3, megatron_schedule=False).loss_scale == pytest.approx(0.2)
    with pytest.raises(ValueError, match="denominator"):
        StepNormalizer(0.0, 2, 3)
    with pytest.raises(ValueError, match="num_microbatches"):
        StepNormalizer(1.0, 2, 0)
    m = torch.tensor([[True, False, True], [False, False, False]])
    assert global_loss_denominator([m, m[:1, :2]], "token_mean", None) == 3.0
    assert global_loss_denominator(m, "seq_mean_token_sum", None) == 1.0
    with pytest.raises(ValueError, match="aggregation"):
        global_loss_denominator(m, "mean", None)


def test_counts_travel_on_each_groups_collective_device(monkeypatch):
    """NCCL takes no CPU tensors: the all-reduces run on ``collective_device(group)`` (the
    current CUDA device for an NCCL group), not on the masks' device (CPU in the trainer).
    CPU-only here, so the groups are stand-ins, the device is asked for and recorded, and the
    collectives are recorded."""
    import nemo_d3s.distributed.normalizers as norm

    dp, cp = object(), object()
    asked, reduced = [], []

    def fake_collective_device(g):
        asked.append(g)
        return torch.device("cpu")

    def fake_all_reduce(t, op=None, group=None):
        reduced.append(group)
        if op == norm.dist.ReduceOp.SUM:
            t.mul_(2)  # two members holding the same count

    monkeypatch.setattr(norm, "is_single", lambda g: g is None)
    monkeypatch.setattr(norm, "collective_device", fake_collective_device)
    monkeypatch.setattr(norm.dist, "all_reduce", fake_all_reduce)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert norm.global_loss_denominator(mask, "token_mean", dp, cp_group=cp) == 8.0
    assert asked == reduced == [dp, cp]
    asked.clear(), reduced.clear()
    assert norm.global_loss_denominator(mask, "seq_mean_token_mean", dp, cp_group=cp) == 2.0
    assert asked == reduced == [cp, dp]
