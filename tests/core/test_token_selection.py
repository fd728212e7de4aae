"""Token selection: hand-worked cases, a pure-Python sort reference (ties included), exact
counts, permutation invariance, scope semantics by construction, compaction, validation."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_d3s.core.token_selection import (
    TOKEN_SELECTORS,
    k_frac_with_floor,
    kept_lengths,
    n_tokens_to_keep,
    n_tokens_to_keep_per_row,
    rows_with_kept_tokens,
    select_tokens,
    token_scores,
    top_k_mask,
)

# ---------------------------------------------------------------------------- references


def _ref_top_k(scores, eligible, k):
    """Slow obvious reference: sort (-score, flat index) pairs in pure Python."""
    S = len(scores[0]) if scores else 0
    pairs = sorted(
        (-scores[b][s], b * S + s) for b in range(len(scores)) for s in range(S) if eligible[b][s]
    )
    keep = [[False] * S for _ in scores]
    for _, i in pairs[:k]:
        keep[i // S][i % S] = True
    return keep


def _ref_select(scores, eligible, k_frac, scope):
    if scope == "all":
        return [list(r) for r in eligible]
    if scope == "batch":
        n = sum(sum(r) for r in eligible)
        return _ref_top_k(scores, eligible, n_tokens_to_keep(n, k_frac))
    return [
        _ref_top_k([s], [e], n_tokens_to_keep(sum(e), k_frac))[0] for s, e in zip(scores, eligible)
    ]


def _random_case(rng: random.Random, B, S, tie_values=None, p_eligible=0.7):
    if tie_values:
        scores = [[float(rng.choice(tie_values)) for _ in range(S)] for _ in range(B)]
    else:
        scores = [[rng.uniform(-1, 5) for _ in range(S)] for _ in range(B)]
    eligible = [[rng.random() < p_eligible for _ in range(S)] for _ in range(B)]
    return scores, eligible


# ---------------------------------------------------------------------------- counts


@pytest.mark.parametrize(
    "n, k, expected",
    [
        (10, 0.2, 2),  # 2.0 exactly
        (30, 0.1, 3),  # 0.1 x 30 = 3.0000000000000004 in floats; must not become 4
        (7, 0.5, 4),  # ceil(3.5)
        (1, 0.01, 1),  # any K > 0 keeps one token of a non-empty pool
        (0, 0.5, 0),
        (5, 1.0, 5),
        (100, 0.05, 5),
        (101, 0.05, 6),  # 5.05 -> 6
        (3, 0.7, 3),  # 2.1 -> 3; 0.7 x 3 = 2.0999999999999996 in floats
    ],
)
def test_n_tokens_to_keep_hand_cases(n, k, expected):
    assert n_tokens_to_keep(n, k) == expected


def test_n_tokens_to_keep_vector_matches_scalar():
    ks = [0.05, 0.1, 0.2, 0.3, 1 / 3, 0.7, 0.123456789, 0.05 + 0.15 * 0.37, 1.0, 1e-9]
    n = torch.arange(0, 5001)
    for k in ks:
        vec = n_tokens_to_keep_per_row(n, k).tolist()
        assert vec == [n_tokens_to_keep(i, k) for i in range(5001)], k
        # and it is the true ceil except for float noise in K itself
        for i in (7, 123, 4999):
            assert vec[i] in (math.ceil(k * i), math.ceil(k * i) - 1)


@pytest.mark.parametrize(
    "k, n, m, expected_k, expected_count",
    [
        (0.05, 200, 0, 0.05, 10),  # no floor
        (0.05, 200, 64, 0.32, 64),  # 10 < 64: K raised to 64 / 200
        (0.05, 1600, 64, 0.05, 80),  # 80 >= 64: inert
        (0.05, 40, 64, 1.0, 40),  # fewer eligible than the floor: all of them
        (0.2, 0, 64, 0.2, 0),  # empty pool: K unchanged
    ],
)
def test_k_frac_with_floor_hand_cases(k, n, m, expected_k, expected_count):
    got = k_frac_with_floor(k, n, m)
    assert got == pytest.approx(expected_k, rel=1e-15)
    assert n_tokens_to_keep(n, got) == expected_count


def test_k_frac_with_floor_keeps_exactly_max_of_k_and_floor():
    """Every pool size n and floor m <= 600 (and K values whose products sit on or near
    integers): the batch scope keeps max(ceil(K n), min(m, n)) tokens, never one more."""
    for k in (0.05, 0.1, 0.2, 1 / 3, 0.7):
        for n in range(1, 601):
            base = n_tokens_to_keep(n, k)
            for m in range(0, 601, 7):
                assert n_tokens_to_keep(n, k_frac_with_floor(k, n, m)) == max(base, min(m, n)), (
                    k,
                    n,
                    m,
                )


def test_k_frac_with_floor_validates():
    with pytest.raises(ValueError, match="min_tokens"):
        k_frac_with_floor(0.1, 10, -1)
    with pytest.raises(ValueError, match="n_eligible"):
        k_frac_with_floor(0.1, 2.5, 3)
    with pytest.raises(ValueError, match="k_frac"):
        k_frac_with_floor(0.0, 10, 3)


# ---------------------------------------------------------------------------- scores


def test_token_scores_hand_case():
    adv = torch.tensor([-2.0, 0.5])
    ent = torch.tensor([[1.0, 3.0, float("nan")], [4.0, 0.0, 2.0]])
    eligible = torch.tensor([[True, True, False], [True, True, True]])
    scores = token_scores(adv, ent, eligible)
    assert scores.dtype == torch.float32
    # |A| x H: row 0: 2 x 1, 2 x 3, (padding -> 0 even though H is NaN); row 1: 0.5 x 4, 0, 0.5 x 2
    assert scores.tolist() == [[2.0, 6.0, 0.0], [2.0, 0.0, 1.0]]


def test_token_scores_per_token_advantages_match_broadcast():
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(4, generator=g)
    ent = torch.rand(4, 6, generator=g)
    eligible = torch.rand(4, 6, generator=g) < 0.6
    a = token_scores(adv, ent, eligible)
    b = token_scores(adv.unsqueeze(1).expand(4, 6).contiguous(), ent, eligible)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------- top-k


def test_top_k_mask_ties_go_to_lower_flat_index():
    scores = torch.tensor([[1.0, 3.0, 3.0], [3.0, 0.0, 2.0]])
    eligible = torch.ones(2, 3, dtype=torch.bool)
    # flat scores [1, 3, 3, 3, 0, 2]: the three 3s are at flat 1, 2, 3
    assert top_k_mask(scores, eligible, 2).tolist() == [[False, True, True], [False, False, False]]
    assert top_k_mask(scores, eligible, 3).tolist() == [[False, True, True], [True, False, False]]
    assert top_k_mask(scores, eligible, 4).tolist() == [[False, True, True], [True, False, True]]
    # an ineligible high score is never taken, and k is capped at the eligible count
    eligible[0, 1] = False
    assert top_k_mask(scores, eligible, 2).tolist() == [[False, False, True], [True, False, False]]
    assert int(top_k_mask(scores, eligible, 100).sum()) == 5
    assert not top_k_mask(scores, eligible, 0).any()


def test_sample_scope_hand_case():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.9], [2.0, 1.0, 0.0, 0.0]])
    eligible = torch.tensor([[True, True, True, True], [True, True, False, False]])
    # K = 0.5: row 0 keeps ceil(0.5 x 4) = 2 -> the two 0.9s; row 1 keeps ceil(0.5 x 2) = 1 -> 2.0
    keep = TOKEN_SELECTORS.get("sample")(scores, eligible, 0.5)
    assert keep.tolist() == [[False, True, False, True], [True, False, False, False]]
    # K = 0.3: row 0 ceil(1.2) = 2 -> the 0.9s tie, both kept; row 1 ceil(0.6) = 1
    keep = TOKEN_SELECTORS.get("sample")(scores, eligible, 0.3)
    assert keep.tolist() == [[False, True, False, True], [True, False, False, False]]
    # K = 0.2: row 0 ceil(0.8) = 1 -> tie between positions 1 and 3 goes to 1
    keep = TOKEN_SELECTORS.get("sample")(scores, eligible, 0.2)
    assert keep.tolist() == [[False, True, False, False], [True, False, False, False]]


@pytest.mark.parametrize("scope", ["all", "batch", "sample"])
def test_matches_python_reference_random_with_ties(scope):
    rng = random.Random(1234)
    for trial in range(150):
        B, S = rng.randint(1, 6), rng.randint(1, 9)
        ties = [0.0, 1.0, 2.0] if trial % 2 else None
        scores, eligible = _random_case(rng, B, S, ties)
        k = rng.choice([0.05, 0.1, 0.2, 1 / 3, 0.5, 0.77, 1.0])
        got = TOKEN_SELECTORS.get(scope)(torch.tensor(scores), torch.tensor(eligible), k)
        assert got.tolist() == _ref_select(scores, eligible, k, scope), (scope, trial)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 5),
    S=st.integers(1, 8),
    k=st.floats(min_value=1e-3, max_value=1.0),
    data=st.data(),
)
def test_exact_counts_property(B, S, k, data):
    vals = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5])
    scores = torch.tensor(
        data.draw(st.lists(st.lists(vals, min_size=S, max_size=S), min_size=B, max_size=B))
    )
    eligible = torch.tensor(
        data.draw(st.lists(st.lists(st.booleans(), min_size=S, max_size=S), min_size=B, max_size=B))
    )
    n = int(eligible.sum())
    batch = TOKEN_SELECTORS.get("batch")(scores, eligible, k)
    sample = TOKEN_SELECTORS.get("sample")(scores, eligible, k)
    assert not (batch & ~eligible).any() and not (sample & ~eligible).any()
    count = n_tokens_to_keep(n, k)
    assert int(batch.sum()) == count
    # ceil(K n), give or take the float noise of K itself; never 0 for a non-empty pool
    assert k * n * (1 - 1e-9) <= count <= math.ceil(k * n) and (count >= 1 or n == 0)
    per_row = [n_tokens_to_keep(int(r), k) for r in eligible.sum(1)]
    assert sample.sum(1).tolist() == per_row
    assert batch.tolist() == _ref_select(scores.tolist(), eligible.tolist(), k, "batch")
    assert sample.tolist() == _ref_select(scores.tolist(), eligible.tolist(), k, "sample")


@pytest.mark.parametrize("scope", ["batch", "sample"])
def test_permutation_of_samples_permutes_selection(scope):
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        B, S = 6, 11
        scores = torch.rand(B, S, generator=g)  # continuous: no ties (checked)
        assert scores.flatten().unique().numel() == B * S
        eligible = torch.rand(B, S, generator=g) < 0.7
        eligible[0, 0] = True
        perm = torch.randperm(B, generator=g)
        keep = TOKEN_SELECTORS.get(scope)(scores, eligible, 0.3)
        keep_p = TOKEN_SELECTORS.get(scope)(scores[perm], eligible[perm], 0.3)
        # row i of the permuted batch is row perm[i] of the original
        assert torch.equal(keep_p, keep[perm])
        pairs = {(int(perm[i]), s) for i, s in keep_p.nonzero().tolist()}
        assert pairs == {tuple(p) for p in keep.nonzero().tolist()}


def test_scope_semantics_by_construction():
    B, S = 4, 10
    eligible = torch.ones(B, S, dtype=torch.bool)
    scores = torch.rand(B, S, generator=torch.Generator().manual_seed(0))
    scores[2] += 100.0  # one row dominates every other
    k = 0.2  # 40 eligible -> 8 tokens in batch scope; 2 per row in sample scope
    batch = select_tokens(scores, eligible, k, scope="batch")
    assert batch.n_kept == 8 and batch.n_eligible == 40
    assert batch.token_keep.sum(1).tolist() == [0, 0, 8, 0]
    assert batch.samples_without_tokens == 3 and batch.samples_without_eligible == 0
    sample = select_tokens(scores, eligible, k, scope="sample")
    assert sample.token_keep.sum(1).tolist() == [2, 2, 2, 2]
    assert sample.samples_without_tokens == 0
    # sample scope keeps the best 2 of row 2, which batch scope also kept
    assert not (sample.token_keep[2] & ~batch.token_keep[2]).any()
    alls = select_tokens(scores, eligible, k, scope="all")
    assert torch.equal(alls.token_keep, eligible) and alls.n_kept == 40


def test_select_tokens_counts_rows_without_eligible_separately():
    scores = torch.tensor([[5.0, 4.0], [1.0, 1.0], [0.0, 0.0]])
    eligible = torch.tensor([[True, True], [True, False], [False, False]])
    sel = select_tokens(scores, eligible, 0.5, scope="batch")  # 3 eligible -> keep 2
    assert sel.token_keep.tolist() == [[True, True], [False, False], [False, False]]
    assert (sel.n_eligible, sel.n_kept) == (3, 2)
    assert sel.samples_without_tokens == 1  # row 1: had an eligible token, kept none
    assert sel.samples_without_eligible == 1  # row 2: nothing eligible
    sel = select_tokens(scores, eligible, 0.5, scope="sample")
    assert sel.token_keep.tolist() == [[True, False], [True, False], [False, False]]
    assert (sel.samples_without_tokens, sel.samples_without_eligible) == (0, 1)


def test_select_tokens_nothing_eligible_raises():
    with pytest.raises(ValueError, match="eligible selects no token"):
        select_tokens(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), 0.5)
    # the scope functions themselves return an empty mask (shard-local use)
    for scope in TOKEN_SELECTORS:
        assert not TOKEN_SELECTORS.get(scope)(
            torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), 0.5
        ).any()


def test_selection_is_deterministic_and_ignores_ineligible_garbage():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (5, 9), generator=g).float()
    eligible = torch.rand(5, 9, generator=g) < 0.5
    garbage = scores.clone()
    garbage[~eligible] = float("nan")
    for scope in ("batch", "sample"):
        a = select_tokens(scores, eligible, 0.4, scope=scope).token_keep
        b = select_tokens(scores, eligible, 0.4, scope=scope).token_keep
        c = select_tokens(garbage, eligible, 0.4, scope=scope).token_keep
        assert torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------------------- compaction


def test_compaction_hand_case():
    keep = torch.tensor(
        [
            [False, True, False, True, False],
            [False, False, False, False, False],
            [True, False, False, False, False],
            [False, False, False, False, True],
        ]
    )
    assert rows_with_kept_tokens(keep).tolist() == [0, 2, 3]
    assert kept_lengths(keep).tolist() == [4, 0, 1, 5]
    assert kept_lengths(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]
    assert rows_with_kept_tokens(torch.zeros(0, 4, dtype=torch.bool)).tolist() == []


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=6))
def test_compaction_keeps_every_kept_token(rows):
    keep = torch.tensor(rows)
    lengths = kept_lengths(keep)
    for b, row in enumerate(rows):
        last = max((s for s, v in enumerate(row) if v), default=-1)
        assert lengths[b].item() == last + 1
    within = torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)
    assert not (keep & ~within).any()
    assert rows_with_kept_tokens(keep).tolist() == [b for b, r in enumerate(rows) if any(r)]


# ---------------------------------------------------------------------------- validation


def test_validation_messages():
    scores = torch.rand(2, 3)
    eligible = torch.ones(2, 3, dtype=torch.bool)
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="k_frac"):
            select_tokens(scores, eligible, bad)
    with pytest.raises(ValueError, match="k_frac"):
        n_tokens_to_keep(3, 0)
    with pytest.raises(ValueError, match="n_eligible"):
        n_tokens_to_keep(-1, 0.5)
    nan_scores = scores.clone()
    nan_scores[1, 2] = float("inf")
    with pytest.raises(ValueError, match="scores.*finite"):
        select_tokens(nan_scores, eligible, 0.5)
    with pytest.raises(ValueError, match="eligible must be a bool"):
        select_tokens(scores, eligible.float(), 0.5)
    with pytest.raises(ValueError, match=r"scores has shape \(2, 4\)"):
        select_tokens(torch.rand(2, 4), eligible, 0.5)
    with pytest.raises(ValueError, match="different devices"):
        select_tokens(torch.rand(2, 3, device="meta"), eligible, 0.5)
    with pytest.raises(ValueError, match="unknown token selection scope 'global'.*batch"):
        select_tokens(scores, eligible, 0.5, scope="global")
    with pytest.raises(ValueError, match="k must be an int"):
        top_k_mask(scores, eligible, 1.5)
    with pytest.raises(ValueError, match="entropy.*finite"):
        token_scores(torch.ones(2), torch.full((2, 3), float("nan")), eligible)
    with pytest.raises(ValueError, match="advantages.*finite"):
        token_scores(torch.tensor([1.0, float("nan")]), torch.ones(2, 3), eligible)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        token_scores(torch.ones(3), torch.ones(2, 3), eligible)
    with pytest.raises(ValueError, match="token_keep must be a bool"):
        kept_lengths(torch.ones(2, 3))
    with pytest.raises(ValueError, match="token_keep must be 2-D"):
        rows_with_kept_tokens(torch.ones(3, dtype=torch.bool))


def test_n_tokens_to_keep_accepts_an_integer_count_tensor():
    assert n_tokens_to_keep(torch.tensor(30), 0.1) == 3
    with pytest.raises(ValueError, match="n_eligible"):
        n_tokens_to_keep(torch.tensor(3.0), 0.1)
