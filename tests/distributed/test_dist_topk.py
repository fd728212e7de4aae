"""Exact global token top-k (radix selection) and the local / gather-quantile scopes.

One launch of 4 gloo ranks (Megatron TP2 x DP2): every case runs on the world group (DP4)
and on the rank's DP group of size 2. The parent rebuilds every rank's data, concatenates
the eligible scores in (group rank, flattened index) order and compares the masks EXACTLY
with (a) a slow obvious reference: Python sort of (-score, rank, index) tuples, first k;
(b) core.token_selection.top_k_mask on the concatenation. Selection is a comparison of
float32 values, so exact equality is the right test.
"""

from __future__ import annotations

import math

import pytest
import torch

from _launch import run_ranks

pytestmark = pytest.mark.distributed

CASES = [
    "random",
    "ties",
    "zero_eligible_rank",
    "empty_rank",
    "nobody_eligible",
    "signed_zero_extremes",
    "bf16",
]
KS = [0, 1, 5, 17, 10_000]  # 10_000 > every pool: keeps all eligible


def _data(case, rank):
    """(scores [B, S], eligible [B, S]) of ``rank``; B and S differ between ranks."""
    g = torch.Generator().manual_seed(17 * rank + CASES.index(case))
    B, S = 2 + rank % 3, 3 + 2 * rank
    scores = torch.randn(B, S, generator=g) * 2.0
    eligible = torch.rand(B, S, generator=g) < 0.7
    if case == "ties":
        scores = torch.randint(0, 3, (B, S), generator=g).float()
    elif case == "zero_eligible_rank" and rank == 2:
        eligible[:] = False
    elif case == "empty_rank" and rank == 1:
        scores, eligible = scores[:0], eligible[:0]
    elif case == "nobody_eligible":
        eligible[:] = False
    elif case == "signed_zero_extremes":
        vals = torch.tensor([0.0, -0.0, 1e38, -1e38, 1e-45, -1e-45, -3.0, 3.0, -0.0])
        scores = vals[torch.randint(0, vals.numel(), (B, S), generator=g)]
    elif case == "bf16":
        scores = scores.to(torch.bfloat16)
    scores[~eligible] = float("nan")  # never read: must not matter
    return scores, eligible


def _slow_reference(parts, k):
    """parts: [(scores, eligible)] in group-rank order -> list of keep masks."""
    items = []
    for r, (s, e) in enumerate(parts):
        flat_s, flat_e = s.float().reshape(-1).tolist(), e.reshape(-1).tolist()
        items += [(-(v + 0.0), r, i) for i, (v, ok) in enumerate(zip(flat_s, flat_e)) if ok]
    items.sort()
    keep = [torch.zeros(e.numel(), dtype=torch.bool) for _, e in parts]
    for _, r, i in items[:k]:
        keep[r][i] = True
    return [m.view(e.shape) for m, (_, e) in zip(keep, parts)]


def _rank_topk(rank):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed import global_top_k_mask, select_tokens_global, topk

    groups = {
        "world": (dist.group.WORLD, rank),
        "dp": (ps.get_data_parallel_group(), ps.get_data_parallel_rank()),
    }
    out = {}
    for gname, (group, grank) in groups.items():
        for case in CASES:
            scores, eligible = _data(case, rank)
            for k in KS:
                for bits in (8, 16) if k == 5 else (8,):
                    out[gname, case, k, bits] = global_top_k_mask(
                        scores, eligible, k, group, bits_per_round=bits
                    )
            for scope in ("global_exact", "local", "gather_quantile"):
                sel = select_tokens_global(scores, eligible, 0.3, group, scope=scope)
                out[gname, case, scope] = (
                    sel.token_keep,
                    sel.n_eligible_global,
                    sel.n_kept_global,
                    sel.threshold,
                )
        scores, eligible = _data("random", rank)
        topk.TORCH_QUANTILE_MAX = 5  # force the kthvalue fallback
        out[gname, "fallback"] = select_tokens_global(
            scores, eligible, 0.3, group, scope="gather_quantile"
        ).threshold
        topk.TORCH_QUANTILE_MAX = 1 << 24

    # A NaN on one rank's eligible scores: every rank raises the same error, none hangs.
    scores, eligible = _data("random", rank)
    if rank == 3:
        scores[tuple(eligible.nonzero()[0].tolist())] = float("nan")
    try:
        global_top_k_mask(scores, eligible, 3, dist.group.WORLD)
        out["nan"] = None
    except ValueError as e:
        out["nan"] = str(e)
    try:
        select_tokens_global(scores, eligible, 0.5, dist.group.WORLD, scope="gather_quantile")
        out["nan_quantile"] = None
    except ValueError as e:
        out["nan_quantile"] = str(e)

    # Hand-worked: rank 0 [3, 1, 2], rank 1 [2, 5, 2], k = 3 -> 5, 3, then the first tie (rank 0).
    if ps.get_data_parallel_rank() == 0:
        hand = torch.tensor([[3.0, 1.0, 2.0]])
    else:
        hand = torch.tensor([[2.0, 5.0, 2.0]])
    out["hand"] = global_top_k_mask(
        hand, torch.ones_like(hand, dtype=torch.bool), 3, ps.get_data_parallel_group()
    )
    return out, ps.get_data_parallel_rank()


@pytest.fixture(scope="module")
def topk_results():
    return run_ranks(_rank_topk, 4, tp=2)


def _members(results, gname, rank):
    """Global ranks of ``rank``'s group, in group-rank order."""
    if gname == "world":
        return [0, 1, 2, 3]
    return [
        r for r in range(4) if r % 2 == rank % 2
    ]  # Megatron TP2 x DP2: DP groups {0, 2}, {1, 3}


def test_exact_top_k_matches_references(topk_results):
    from nemo_d3s.core.token_selection import top_k_mask

    for gname in ("world", "dp"):
        for rank in range(4):
            members = _members(topk_results, gname, rank)
            for case in CASES:
                parts = [_data(case, r) for r in members]
                n_elig = sum(int(e.sum()) for _, e in parts)
                for k in KS:
                    expect = _slow_reference(parts, k)
                    # The core single-process top-k on the concatenation gives the same set.
                    cat_s = torch.cat([s.float().reshape(-1) for s, _ in parts]).unsqueeze(0)
                    cat_e = torch.cat([e.reshape(-1) for _, e in parts]).unsqueeze(0)
                    core = top_k_mask(torch.where(cat_e, cat_s, 0.0), cat_e, k)
                    core_mine = core[0].split([e.numel() for _, e in parts])[members.index(rank)]
                    mine_expect = expect[members.index(rank)]
                    assert torch.equal(core_mine.view(mine_expect.shape), mine_expect)
                    for bits in (8, 16) if k == 5 else (8,):
                        got = topk_results[rank][0][gname, case, k, bits]
                        assert torch.equal(got, mine_expect), (gname, case, k, bits, rank)
                    total = sum(int(topk_results[r][0][gname, case, k, 8].sum()) for r in members)
                    assert total == min(k, n_elig)


def test_scopes(topk_results):
    from nemo_d3s.core.token_selection import n_tokens_to_keep, top_k_batch

    for gname in ("world", "dp"):
        for rank in range(4):
            members = _members(topk_results, gname, rank)
            for case in CASES:
                parts = [_data(case, r) for r in members]
                n_elig = sum(int(e.sum()) for _, e in parts)
                k = n_tokens_to_keep(n_elig, 0.3)
                res = topk_results[rank][0]
                keep, n_g, kept_g, _ = res[gname, case, "global_exact"]
                assert torch.equal(keep, _slow_reference(parts, k)[members.index(rank)])
                assert (n_g, kept_g) == (n_elig, k)
                # local: the rank's own top 30%, no collective.
                s, e = parts[members.index(rank)]
                keep, n_g, kept_g, _ = res[gname, case, "local"]
                assert (
                    torch.equal(keep, top_k_batch(torch.where(e, s, 0.0), e, 0.3)) and n_g is None
                )
                # gather_quantile: torch.quantile of every eligible score, keep >= threshold.
                keep, n_g, kept_g, thr = res[gname, case, "gather_quantile"]
                pool = torch.cat([s[e].float() for s, e in parts])
                if pool.numel() == 0:
                    assert not keep.any() and thr is None
                    continue
                ref_thr = torch.quantile(pool, 0.7)
                assert thr == float(ref_thr)
                assert torch.equal(keep, e & (s.float() >= ref_thr))
                assert kept_g == int((pool >= ref_thr).sum())
            # kthvalue fallback reproduces torch.quantile's linear interpolation
            parts = [_data("random", r) for r in members]
            pool = torch.cat([s[e].float() for s, e in parts])
            assert topk_results[rank][0][gname, "fallback"] == pytest.approx(
                float(torch.quantile(pool, 0.7)), rel=1e-6
            )


def test_nan_on_one_rank_fails_every_rank(topk_results):
    for out, _ in topk_results:
        assert out["nan"] is not None and "finite" in out["nan"]
        assert out["nan_quantile"] is not None and "finite" in out["nan_quantile"]


def test_hand_worked_case(topk_results):
    for out, dp_rank in topk_results:
        expect = [[True, False, True]] if dp_rank == 0 else [[False, True, False]]
        assert out["hand"].tolist() == expect


def test_single_process_fallbacks_and_keys():
    from nemo_d3s.core.token_selection import top_k_mask
    from nemo_d3s.distributed import global_top_k_mask, select_tokens_global
    from nemo_d3s.distributed.topk import float_order_keys, quantile_linear

    scores, eligible = _data("ties", 0)
    assert torch.equal(
        global_top_k_mask(scores, eligible, 4, None), top_k_mask(scores, eligible, 4)
    )
    assert select_tokens_global(scores, eligible, 0.5, None).n_kept == math.ceil(
        0.5 * int(eligible.sum())
    )
    v = torch.tensor([-math.inf, -1e38, -2.0, -1e-45, -0.0, 0.0, 1e-45, 1.5, 1e38, math.inf])
    keys = float_order_keys(v)
    assert keys.tolist() == sorted(keys.tolist()) and keys[4] == keys[5]
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**32
    assert len(set(keys.tolist())) == v.numel() - 1
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    import nemo_d3s.distributed.topk as topk

    old = topk.TORCH_QUANTILE_MAX
    try:
        topk.TORCH_QUANTILE_MAX = 10
        for q in (0.0, 0.13, 0.5, 0.8, 1.0):
            assert float(quantile_linear(x, q)) == pytest.approx(
                float(torch.quantile(x, q)), rel=1e-6, abs=1e-7
            )
    finally:
        topk.TORCH_QUANTILE_MAX = old
    with pytest.raises(ValueError, match="unknown distributed token selection scope"):
        select_tokens_global(scores, eligible, 0.5, None, scope="nope")
    with pytest.raises(ValueError, match="k must be"):
        global_top_k_mask(scores, eligible, -1, None)
