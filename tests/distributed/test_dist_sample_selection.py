"""DP-global sample selection and token rebalancing (DP4, uneven rank loads).

One launch of 4 gloo ranks (Megatron DP4). Rank loads differ on purpose: 3, 1, 0 and 2
prompt groups (rank 2 holds no sample at all), group sizes differ, local group ids repeat
across ranks (0..n-1 everywhere) and rank 1's only group is degenerate (equal rewards), so
d3s_cross keeps none of its samples. The parent compares every rank's selection EXACTLY
with core.select_samples on the concatenated batch (groups made distinct), and the
rebalancing with a slow list-based LPT reference and with the rows it should receive.
"""

from __future__ import annotations

import pytest
import torch

from _launch import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 4
GROUPS = {0: [4, 4, 3], 1: [4], 2: [], 3: [5, 4]}  # group sizes per rank
RULES = [
    ("all", 1.0),
    ("random", 2),
    ("max_reward", 2),
    ("pods", 2),
    ("d3s_intra", 0.5),
    ("d3s_cross", 2),
    ("d3s_cross", 0.25),
]
S = 6


def _batch(rank):
    """rewards [B], local group ids [B], per-sample token counts [B], per-token tensors."""
    g = torch.Generator().manual_seed(rank + 11)
    sizes = GROUPS[rank]
    gids = (
        torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sizes)])
        if sizes
        else torch.zeros(0, dtype=torch.long)
    )
    rewards = torch.randint(0, 2, (gids.numel(),), generator=g).float() + 0.1 * torch.rand(
        gids.numel(), generator=g
    )
    if rank == 1:
        rewards[:] = 1.0  # degenerate group: all advantages 0
    lengths = torch.randint(0, S + 1, (gids.numel(),), generator=g)
    lengths[::3] = S  # a few long ones
    ids = torch.randint(0, 1000, (gids.numel(), S), generator=g)
    token_keep = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)
    return rewards, gids, lengths, ids, token_keep


def _advantages(rewards, gids):
    from nemo_d3s.core.advantages import compute_advantages

    if rewards.numel() == 0:
        return torch.zeros(0)
    return compute_advantages(rewards, gids).advantages


def _rank_select(rank):
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed import apply_rebalance, global_select_samples, plan_rebalance

    dp = ps.get_data_parallel_group()
    assert ps.get_data_parallel_world_size() == WORLD
    rewards, gids, lengths, ids, token_keep = _batch(rank)
    adv = _advantages(rewards, gids)
    out = {}
    for rule, n in RULES:
        gen = torch.Generator().manual_seed(5)  # same seed on every rank
        sel = global_select_samples(rule, rewards, adv, gids, n, dp, generator=gen)
        out[rule, n] = (sel.sample_keep, sel.advantages, sel.n_kept_global, sel.global_sample_keep)
        # Move the kept samples so that every rank trains on about the same number of tokens.
        plan = plan_rebalance(lengths, sel.sample_keep, dp)
        tensors = {
            "ids": ids,
            "token_keep": token_keep,
            "adv": sel.advantages,
            "lp": torch.randn(ids.shape).bfloat16(),
        }
        moved = apply_rebalance(plan, tensors, dp, zero_on_pad=["token_keep"])
        out["plan", rule, n] = (
            plan.dest,
            plan.pad_source,
            plan.tokens_before,
            plan.tokens_after,
            plan.imbalance_before,
            plan.imbalance_after,
            plan.n_kept,
        )
        out["moved", rule, n] = (moved.tensors, moved.weight, moved.sample_index, moved.is_pad)
    # Hand-worked: one group per rank on ranks 0 and 1, both with id 7 (distinct groups all
    # the same); pooled advantages {1.5, -1.5, 0.5, -0.5 | 0, 0}, N = 1 per prompt -> keep 2:
    # the max-variance pair is {1.5, -1.5}, both on rank 0.
    hand = {0: [1.5, -1.5, 0.5, -0.5], 1: [0.0, 0.0]}.get(rank, [])
    a = torch.tensor(hand)
    sel = global_select_samples("d3s_cross", (a > 0).float(), a, torch.full((a.numel(),), 7), 1, dp)
    out["hand"] = (sel.sample_keep.tolist(), sel.n_kept_global)
    # Fewer kept samples (2, both on rank 3) than ranks: two ranks get a zero-weight pad.
    keep = torch.zeros(ids.shape[0], dtype=torch.bool)
    if rank == 3:
        keep[[1, 4]] = True
    plan = plan_rebalance(lengths, keep, dp)
    moved = apply_rebalance(
        plan, {"ids": ids, "token_keep": token_keep}, dp, zero_on_pad=["token_keep"]
    )
    out["pad_case"] = (plan.dest, plan.pad_source, moved.tensors, moved.weight, moved.sample_index)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank_select, WORLD, tp=1)


def _global_batch():
    parts = [_batch(r) for r in range(WORLD)]
    rewards = torch.cat([p[0] for p in parts])
    gids, offset = [], 0
    for p in parts:
        gids.append(p[1] + offset)
        offset += len(torch.unique(p[1]))
    gids = torch.cat(gids)
    adv = torch.cat([_advantages(p[0], p[1]) for p in parts])
    counts = [p[0].numel() for p in parts]
    return parts, rewards, gids, adv, counts


def test_selection_equals_single_process(results):
    from nemo_d3s.core.sample_selection import select_samples

    parts, rewards, gids, adv, counts = _global_batch()
    for rule, n in RULES:
        ref = select_samples(
            rule, rewards, adv, gids, n, generator=torch.Generator().manual_seed(5)
        )
        keep_parts = ref.sample_keep.split(counts)
        adv_parts = ref.advantages.split(counts)
        for r in range(WORLD):
            keep, a, n_global, global_keep = results[r][rule, n]
            assert torch.equal(keep, keep_parts[r]), (rule, n, r)
            assert torch.equal(a, adv_parts[r]), (rule, n, r)
            assert n_global == ref.n_kept and torch.equal(global_keep, ref.sample_keep)
    # The case list exercises a rank that keeps nothing while others keep samples.
    keep, *_ = results[1]["d3s_cross", 2]
    assert keep.numel() == 4 and not keep.any()
    assert results[2]["all", 1.0][0].numel() == 0


def _slow_lpt(tokens, world):
    load, cnt, dest = [0] * world, [0] * world, []
    order = sorted(range(len(tokens)), key=lambda j: (-tokens[j], j))
    dest = [None] * len(tokens)
    for j in order:
        r = min(range(world), key=lambda q: (load[q], cnt[q], q))
        dest[j] = r
        load[r] += tokens[j]
        cnt[r] += 1
    return dest


def test_rebalance_plan_and_moved_rows(results):
    parts, *_ = _global_batch()
    for rule, n in RULES:
        global_keep = results[0][rule, n][3]
        lengths = torch.cat([p[2] for p in parts])
        ids = torch.cat([p[3] for p in parts])
        token_keep = torch.cat([p[4] for p in parts])
        kept = global_keep.nonzero().flatten()
        tokens = lengths[kept].tolist()
        plans = [results[r]["plan", rule, n] for r in range(WORLD)]
        for p in plans[1:]:  # identical on every rank
            assert all(
                torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(p, plans[0])
            )
        dest, pad_source, before, after, imb_before, imb_after, n_kept = plans[0]
        assert dest.tolist() == _slow_lpt(tokens, WORLD)
        assert imb_after <= imb_before + 1e-12
        if sum(tokens):
            assert float(after.max()) <= sum(tokens) / WORLD + max(tokens)  # greedy bound
        for r in range(WORLD):
            moved, weight, j, is_pad = results[r]["moved", rule, n]
            assert j.numel() >= 1  # nobody trains on zero samples
            real = j[~is_pad]
            assert torch.equal(real, (dest == r).nonzero().flatten())
            assert torch.equal(moved["ids"], ids[kept[j]])
            expect_keep = token_keep[kept[j]] & ~is_pad.unsqueeze(1)
            assert torch.equal(moved["token_keep"], expect_keep)
            assert torch.equal(weight, (~is_pad).float())
            assert moved["lp"].dtype == torch.bfloat16 and moved["lp"].shape == (j.numel(), S)
            if is_pad.any():
                assert n_kept < WORLD and int(pad_source[r]) == 0 and j.tolist() == [0]


def test_hand_worked_cross_group(results):
    expect = {0: [True, True, False, False], 1: [False, False], 2: [], 3: []}
    for r in range(WORLD):
        assert results[r]["hand"] == (expect[r], 2)


def test_fewer_kept_than_ranks_distributed(results):
    _, _, lengths, ids, token_keep = _batch(3)
    rows = [1, 4]
    for r in range(WORLD):
        dest, pad_source, moved, weight, j = results[r]["pad_case"]
        long_first = 0 if lengths[1] >= lengths[4] else 1
        assert dest.tolist() == ([0, 1] if long_first == 0 else [1, 0])
        assert pad_source.tolist() == [-1, -1, 0, 0]
        expect_j = [0] if r >= 2 else [dest.tolist().index(r)]
        assert j.tolist() == expect_j
        assert torch.equal(moved["ids"], ids[[rows[expect_j[0]]]])
        if r >= 2:
            assert weight.tolist() == [0.0] and not moved["token_keep"].any()
        else:
            assert weight.tolist() == [1.0] and torch.equal(
                moved["token_keep"], token_keep[[rows[expect_j[0]]]]
            )


def test_fewer_kept_than_ranks_gets_zero_weight_pads():
    from nemo_d3s.distributed.rebalance import plan_from_tokens

    plan = plan_from_tokens(
        torch.tensor([5, 0]),
        torch.tensor([3, 3]),
        torch.tensor([0, 4]),
        4,
        torch.tensor([0, 0, 0, 5]),
    )
    assert plan.dest.tolist() == [0, 1]  # the zero-token sample still goes to an empty rank
    assert plan.pad_source.tolist() == [-1, -1, 0, 0]
    js, w = plan.samples_of(2)
    assert js.tolist() == [0] and w.tolist() == [0.0]
    assert plan.tokens_before.tolist() == [0, 0, 0, 5] and plan.imbalance_before == 4.0
    assert plan.tokens_after.tolist() == [5, 0, 0, 0]
    empty = plan_from_tokens(
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        3,
        torch.tensor([1, 1, 1]),
    )
    assert empty.pad_source.tolist() == [-1, -1, -1] and empty.imbalance_after == 1.0


def test_single_process_fallback():
    from nemo_d3s.core.sample_selection import select_samples
    from nemo_d3s.distributed import apply_rebalance, global_select_samples, plan_rebalance

    rewards, gids, lengths, ids, token_keep = _batch(0)
    adv = _advantages(rewards, gids)
    sel = global_select_samples("d3s_cross", rewards, adv, gids, 2, None)
    ref = select_samples("d3s_cross", rewards, adv, gids, 2)
    assert torch.equal(sel.sample_keep, ref.sample_keep) and sel.n_kept_global == ref.n_kept
    plan = plan_rebalance(lengths, sel.sample_keep, None)
    moved = apply_rebalance(plan, {"ids": ids}, None)
    assert torch.equal(moved.tensors["ids"], ids[sel.sample_keep])
