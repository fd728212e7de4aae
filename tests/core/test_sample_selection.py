"""Sample selection: the max-variance lemma against brute force, grouped rules against slow
per-group loops, hand-worked cases, the papers' variance claims, validation messages."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nemo_d3s.core.advantages import compute_advantages
from nemo_d3s.core.sample_selection import (
    PODS_EPS,
    SAMPLE_SELECTORS,
    _n_keep_per_group,
    kept_advantage_variance,
    max_variance_mask,
    max_variance_subset,
    resolve_n_keep,
    select_samples,
    share_nonzero_advantage,
)


def _t(xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


def _ss(vals) -> float:
    """Sum of squared deviations (m x population variance), compensated summation."""
    mean = math.fsum(vals) / len(vals)
    return math.fsum((v - mean) ** 2 for v in vals)


def _brute_best(values, m) -> float:
    return max(_ss([values[i] for i in c]) for c in itertools.combinations(range(len(values)), m))


# ---------------------------------------------------------------------------- lemma vs brute force

continuous = st.lists(st.floats(-100, 100, allow_subnormal=False), min_size=1, max_size=12)
binary = st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=12)
# Few distinct values -> long runs of ties, including runs straddling the top/bottom split.
tied = st.lists(st.sampled_from([-1.5, 0.0, 0.25, 0.25, 2.0, 3.0]), min_size=1, max_size=12)


def _check_against_brute_force(values, m_frac):
    n = len(values)
    m = max(1, min(n, round(m_frac * n)))
    idx = max_variance_subset(_t(values), m)
    assert idx.dtype == torch.long
    chosen = idx.tolist()
    assert len(chosen) == m and len(set(chosen)) == m
    assert chosen == sorted(chosen) and all(0 <= i < n for i in chosen)
    best = _brute_best(values, m)
    got = _ss([values[i] for i in chosen])
    assert got >= best - 1e-9 * abs(best) - 1e-12, (values, m, chosen, got, best)
    assert torch.equal(max_variance_subset(_t(values), m), idx)  # deterministic


@settings(max_examples=150, deadline=None)
@given(values=continuous, m_frac=st.floats(0.0, 1.0))
def test_lemma_matches_brute_force_continuous(values, m_frac):
    _check_against_brute_force(values, m_frac)


@settings(max_examples=100, deadline=None)
@given(values=binary, m_frac=st.floats(0.0, 1.0))
def test_lemma_matches_brute_force_binary(values, m_frac):
    _check_against_brute_force(values, m_frac)


@settings(max_examples=100, deadline=None)
@given(values=tied, m_frac=st.floats(0.0, 1.0))
def test_lemma_matches_brute_force_ties(values, m_frac):
    _check_against_brute_force(values, m_frac)


@settings(max_examples=60, deadline=None)
@given(values=tied, m_frac=st.floats(0.0, 1.0))
def test_ties_prefer_lower_indices(values, m_frac):
    """Swapping a kept index for a LOWER dropped index of the same value is never possible."""
    n = len(values)
    m = max(1, min(n, round(m_frac * n)))
    kept = set(max_variance_subset(_t(values), m).tolist())
    for i in range(n):
        for j in range(i + 1, n):
            if values[i] == values[j] and j in kept:
                assert i in kept, (values, m, sorted(kept))


def _two_valued_reference(values, m):
    """Independent of the lemma: every m-subset's sum of squared deviations in exact
    rational arithmetic (Fraction of each float), the best ones, among them those whose sum is
    closest to m x the mean, and among those the documented rule for two-valued rows: the side
    of the first value (above the mean: the most HIGH values, else the most LOW), then the
    lowest indices of each value."""
    from fractions import Fraction

    exact = [Fraction(v) for v in values]
    mean_all = sum(exact) / len(exact)

    def ss(c):
        mean = sum(exact[i] for i in c) / m
        return sum((exact[i] - mean) ** 2 for i in c)

    def off(c):
        return abs(sum(exact[i] for i in c) - m * mean_all)

    combos = list(itertools.combinations(range(len(values)), m))
    best = max(ss(c) for c in combos)
    tied = [c for c in combos if ss(c) == best]
    centred = [c for c in tied if off(c) == min(off(c) for c in tied)]
    low = min(values)
    counts = [sum(values[i] == low for i in c) for c in centred]
    lows = min(counts) if exact[0] > mean_all else max(counts)
    low_idx = [i for i, v in enumerate(values) if v == low][:lows]
    high_idx = [i for i, v in enumerate(values) if v != low][: m - lows]
    return sorted(low_idx + high_idx)


@given(values=st.lists(st.integers(-3, 3), min_size=2, max_size=10), m_frac=st.floats(0.0, 1.0))
def test_the_choice_has_no_sign_preference(values, m_frac):
    """Negated values keep the negated values: no tie is broken toward the bottom (the smallest
    k did that, and a D3S-I step at odd N kept more negative advantages than positive). Small
    integers: exact in float64. A first value exactly at the mean is the one asymmetric case
    (it takes the smallest k either way)."""
    n = len(values)
    m = max(1, min(n, round(m_frac * n)))
    assume(values[0] * n != sum(values))
    kept = sorted(values[i] for i in max_variance_subset(_t(values), m).tolist())
    negated = max_variance_subset(_t([-x for x in values]), m).tolist()
    assert kept == sorted(values[i] for i in negated)


@pytest.mark.parametrize(
    "rewards, m",
    [
        ([1, 0, 0, 1, 0, 1], 5),
        ([1, 1, 1, 0, 0, 0, 0, 1], 5),
        ([1, 0, 1, 0, 0, 0, 1, 1], 7),
    ],
)
@pytest.mark.parametrize("scale", ["shifted", "normalised"])
def test_tied_subsets_follow_the_documented_rule_through_rounding(rewards, m, scale):
    """Binary rewards, half of each, m odd: taking (m+1)/2 lows or (m+1)/2 highs is an exact
    tie (in variance and in distance from the mean), but with values like 0.1 + 0.3 r or
    group-normalised advantages the float64 prefix sums put one candidate ahead by an ulp or
    so. The rounding tolerances keep the documented rule (the side of the first value);
    comparing with ``>= best`` alone picks by rounding and fails here."""
    r = _t(rewards)
    values = (0.1 + 0.3 * r) if scale == "shifted" else (r - r.mean()) / r.std()
    values = values.tolist()
    assert max_variance_subset(_t(values), m).tolist() == _two_valued_reference(values, m)


def test_float32_and_int_inputs():
    assert max_variance_subset(torch.tensor([0.0, 1.0, 0.0, 1.0]), 2).tolist() == [0, 1]
    assert max_variance_subset(torch.tensor([3, 9, 1, 5]), 2).tolist() == [1, 2]


# ---------------------------------------------------------------------------- hand-worked


@pytest.mark.parametrize(
    "values, m, expected",
    [
        ([0, 1, 0, 1], 2, [0, 1]),  # one of each; lowest index of each value
        ([0, 1, 0, 1], 3, [0, 1, 2]),  # k=1 and k=2 tie, both 1/2 off the mean x 3, the
        # first value a 0 -> two 0s + one 1
        ([1, 0, 1, 0], 3, [0, 1, 2]),  # the same tie, the first value a 1: two 1s + one 0
        ([1, 1, 1, 1], 2, [0, 1]),  # all equal: every subset ties -> lowest indices
        ([5, 1, 3, 2, 4], 3, [0, 1, 4]),  # {1,2,5} and {1,4,5} tie (SS 78/9, sums 9 -+ 1)
        # -> the first value's side: 5 is above the mean, {1,4,5}
        ([1, 1, 1, 1, 1, 1, 0, 0], 3, [0, 1, 6]),  # 6 of 8 succeed: the extra from the majority
        ([0, 0, 0, 0, 0, 0, 1, 1], 3, [0, 1, 6]),  # 2 of 8: the extra from the majority
        ([0, 5, 5, 5, 10], 4, [0, 1, 2, 4]),  # run of 5s straddles the split: lowest-index 5s
        ([7, 0, 0, 7, 7], 2, [0, 1]),  # the top pick from a tied run is its lowest index
        ([3, 1, 1], 1, [0]),  # m = 1: every subset has variance 0 -> the farthest from the mean
        ([2.0, -1.0, 0.5, 4.0], 4, [0, 1, 2, 3]),
        ([0.1, 0.9, 0.5, 0.45, 0.55], 2, [0, 1]),
    ],
)
def test_max_variance_hand_worked(values, m, expected):
    assert max_variance_subset(_t(values), m).tolist() == expected


def test_max_variance_mask_batched_rows_independent():
    rows = _t([[0, 1, 0, 1], [5, 4, 3, 2], [1, 1, 1, 1]])
    mask = max_variance_mask(rows, 2)
    for r in range(3):
        assert mask[r].nonzero().flatten().tolist() == max_variance_subset(rows[r], 2).tolist()
    assert max_variance_mask(torch.zeros(0, 5), 2).shape == (0, 5)


def test_large_offset_does_not_cancel():
    # Variance is shift invariant; a huge common offset must not change the choice.
    base = [0.0, 1.0, 0.3, 0.7, 0.2]
    a = max_variance_subset(_t(base), 3)
    b = max_variance_subset(_t([1e9 + x for x in base]), 3)
    assert a.tolist() == b.tolist() == [0, 1, 4]


# ---------------------------------------------------------------------------- resolve_n_keep


@pytest.mark.parametrize(
    "n_keep, g, expected",
    [
        (8, 64, 8),
        (8, 4, 4),  # a small group is kept whole
        (1, 1, 1),
        (0.25, 16, 4),
        (0.125, 4, 1),  # 0.5 rounds half up
        (0.5, 5, 3),  # 2.5 -> 3
        (1.0, 7, 7),
        (0.01, 3, 1),  # at least one
        (0.3, 10, 3),
    ],
)
def test_resolve_n_keep(n_keep, g, expected):
    assert resolve_n_keep(n_keep, g) == expected


@settings(max_examples=100, deadline=None)
@given(
    n_keep=st.integers(1, 40) | st.floats(1e-3, 1.0),
    sizes=st.lists(st.integers(1, 70), min_size=1, max_size=8),
)
def test_vectorised_n_keep_matches_scalar(n_keep, sizes):
    got = _n_keep_per_group(n_keep, torch.tensor(sizes)).tolist()
    assert got == [resolve_n_keep(n_keep, g) for g in sizes]


# --------------------------------------------------------------------------- grouped rules vs loops


def _groups(g):
    out = {}
    for i, x in enumerate(g):
        out.setdefault(x, []).append(i)
    return list(out.values())


def _ref_max_variance_keep(values, g, n_keep):
    keep = [False] * len(values)
    for idx in _groups(g):
        m = resolve_n_keep(n_keep, len(idx))
        if (
            m == 1 and len(idx) > 1
        ):  # one value has no variance: the farthest from the mean, first on ties
            vals = [values[i] for i in idx]
            dev = [abs(v - sum(vals) / len(vals)) for v in vals]
            keep[idx[next(j for j, d in enumerate(dev) if d >= max(dev) * (1 - 1e-6))]] = True
            continue
        sub = max_variance_subset(_t([values[i] for i in idx]), m).tolist()
        for j in sub:
            keep[idx[j]] = True
    return keep


def _ref_max_reward_keep(r, g, n_keep):
    keep = [False] * len(r)
    for idx in _groups(g):
        m = resolve_n_keep(n_keep, len(idx))
        for i in sorted(idx, key=lambda i: (-r[i], i))[:m]:
            keep[i] = True
    return keep


def _ref_pods_advantages(r, g, keep, adv_in):
    out = list(adv_in)
    for idx in _groups(g):
        kept = [i for i in idx if keep[i]]
        vals = [r[i] for i in kept]
        if len(vals) < 2 or max(vals) == min(vals):
            for i in kept:
                out[i] = 0.0
            continue
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in kept:
            out[i] = (r[i] - mean) / (std + PODS_EPS)
    return out


batches = st.lists(
    st.tuples(
        st.integers(0, 5), st.sampled_from([0.0, 1.0]) | st.integers(-50, 50).map(lambda x: x / 10)
    ),
    min_size=1,
    max_size=40,
)
n_keeps = st.integers(1, 6) | st.sampled_from([0.125, 0.25, 0.5, 0.75, 1.0])


@settings(max_examples=80, deadline=None)
@given(data=batches, n_keep=n_keeps)
def test_grouped_rules_match_per_group_loop(data, n_keep):
    g = [d[0] * 7919 - 3 for d in data]  # sparse, unsorted, negative ids
    r = [d[1] for d in data]
    rewards, gids = _t(r), torch.tensor(g)
    adv = compute_advantages(rewards, gids).advantages

    intra = select_samples("d3s_intra", rewards, adv, gids, n_keep)
    assert intra.sample_keep.tolist() == _ref_max_variance_keep(adv.tolist(), g, n_keep)
    assert torch.equal(intra.advantages, adv)

    pods = select_samples("pods", rewards, adv, gids, n_keep)
    ref_keep = _ref_max_variance_keep(r, g, n_keep)
    assert pods.sample_keep.tolist() == ref_keep
    ref_adv = _ref_pods_advantages(r, g, ref_keep, adv.tolist())
    torch.testing.assert_close(
        pods.advantages, torch.tensor(ref_adv, dtype=torch.float32), rtol=1e-5, atol=1e-5
    )

    mr = select_samples("max_reward", rewards, adv, gids, n_keep)
    assert mr.sample_keep.tolist() == _ref_max_reward_keep(r, g, n_keep)

    cross = select_samples("d3s_cross", rewards, adv, gids, n_keep)
    m_total = sum(resolve_n_keep(n_keep, len(idx)) for idx in _groups(g))
    assert cross.n_kept == m_total <= len(r)
    # the pooled rule is the per-group rule on one group holding the whole batch (N = 1 in
    # all included: the farthest from the pool's mean)
    assert cross.sample_keep.tolist() == _ref_max_variance_keep(adv.tolist(), [0] * len(r), m_total)

    for sel in (intra, pods, mr):
        assert sel.n_kept == m_total == int(sel.sample_keep.sum())
        assert sel.advantages.dtype == torch.float32


def test_equal_size_groups_batched_path_matches_loop():
    torch.manual_seed(0)
    n_groups, g_size = 16, 12
    rewards = torch.rand(n_groups * g_size, dtype=torch.float64).round(decimals=1)
    gids = torch.arange(n_groups).repeat_interleave(g_size)[torch.randperm(n_groups * g_size)]
    adv = compute_advantages(rewards, gids).advantages
    sel = select_samples("d3s_intra", rewards, adv, gids, 5)
    assert sel.sample_keep.tolist() == _ref_max_variance_keep(adv.tolist(), gids.tolist(), 5)


# ---------------------------------------------------------------------------- hand-worked rules


def test_rules_hand_worked():
    r = _t([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([4, 4, 4, 4, 9, 9, 9, 9])
    adv = compute_advantages(r, g).advantages
    # max-variance of 2: one correct + one wrong, lowest indices.
    assert select_samples("d3s_intra", r, adv, g, 2).kept_rows.tolist() == [0, 1, 4, 6]
    assert select_samples("max_reward", r, adv, g, 2).kept_rows.tolist() == [0, 2, 6, 7]
    assert select_samples("all", r, adv, g, 2).n_kept == 8
    # Cross-group with 1 per prompt keeps 2 of the pool: equal |A| everywhere, smallest k
    # -> one most negative (index 1) and one most positive (index 0).
    assert select_samples("d3s_cross", r, adv, g, 1).kept_rows.tolist() == [0, 1]


def test_d3s_cross_budget_moves_between_groups():
    # Group 0 is informative, group 1 degenerate: cross-group spends the whole budget of
    # 2 x 2 = 4 on group 0's extreme advantages.
    r = _t([3.0, 0.0, 2.0, 1.0, 5.0, 5.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = compute_advantages(r, g).advantages
    sel = select_samples("d3s_cross", r, adv, g, 2)
    assert sel.kept_rows.tolist() == [0, 1, 2, 3]
    intra = select_samples("d3s_intra", r, adv, g, 2)
    assert intra.kept_rows.tolist() == [0, 1, 4, 5]
    assert share_nonzero_advantage(intra.advantages, intra.sample_keep) == 0.5
    assert share_nonzero_advantage(sel.advantages, sel.sample_keep) == 1.0


def test_d3s_cross_unequal_groups_budget():
    r = _t([0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 4.0])
    g = torch.tensor([1, 1, 2, 2, 2, 2, 2])  # sizes 2 and 5
    adv = compute_advantages(r, g).advantages
    assert select_samples("d3s_cross", r, adv, g, 3).n_kept == 2 + 3
    assert select_samples("d3s_cross", r, adv, g, 0.5).n_kept == 1 + 3  # 0.5x2 -> 1, 0.5x5=2.5 -> 3
    assert select_samples("d3s_cross", r, adv, g, 100).n_kept == 7  # never more than B


def test_pods_hand_worked_renormalisation():
    # Group [0, 1, 1, 0.5], keep 2 -> {0, 1}: mean 0.5, unbiased std sqrt(0.5).
    r = _t([0.0, 1.0, 1.0, 0.5])
    g = torch.tensor([0, 0, 0, 0])
    adv = compute_advantages(r, g).advantages
    sel = select_samples("pods", r, adv, g, 2)
    assert sel.kept_rows.tolist() == [0, 1]
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(sel.advantages[:2], torch.tensor([-a, a], dtype=torch.float32))
    # dropped rows keep their input advantages
    assert torch.equal(sel.advantages[2:], adv[2:])
    # eps and unbiased are configurable
    biased = select_samples("pods", r, adv, g, 2, eps=0.0, unbiased=False)
    torch.testing.assert_close(biased.advantages[:2], torch.tensor([-1.0, 1.0]))
    # a kept subset of one rollout has no spread -> 0
    one = select_samples("pods", r, adv, g, 1)
    assert one.n_kept == 1 and one.advantages[one.sample_keep].item() == 0.0
    # the run's estimator on the kept subset (it was GRPO's whatever was configured):
    # Dr. GRPO r - mean_S = -0.5, 0.5; RLOO r_i - (the other's) = -1, 1
    dr = select_samples("pods", r, adv, g, 2, advantage="dr_grpo")
    assert dr.advantages[:2].tolist() == [-0.5, 0.5]
    rloo = select_samples("pods", r, adv, g, 2, advantage="rloo")
    assert rloo.advantages[:2].tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError, match="advantage estimator"):
        select_samples("pods", r, adv, g, 2, advantage="nope")


def test_pods_baselines_train_grpo_on_their_subset():
    """PODS's baselines (random, max-reward) are GRPO on the kept subset: ``max_reward`` keeps
    the full-group advantages, ``pods_max_reward`` re-normalises them. Group [1, 1, 0, 0, 0, 0],
    N = 2: max-reward keeps rows 0 and 1 (both successes): full-group advantages
    (1 - 1/3) / (std_unbiased + 1e-6) = +1.29 each, a positive-only update; on the subset they
    tie, so PODS's baseline trains nothing on this group."""
    r = _t([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    g = torch.zeros(6, dtype=torch.long)
    adv = compute_advantages(r, g).advantages
    plain = select_samples("max_reward", r, adv, g, 2)
    pods = select_samples("pods_max_reward", r, adv, g, 2)
    assert plain.kept_rows.tolist() == pods.kept_rows.tolist() == [0, 1]
    std = math.sqrt(sum((x - 1 / 3) ** 2 for x in r.tolist()) / 5)
    want_full = torch.full((2,), (2 / 3) / (std + 1e-6), dtype=plain.advantages.dtype)
    torch.testing.assert_close(plain.advantages[:2], want_full)
    assert pods.advantages[:2].tolist() == [0.0, 0.0]
    # random: the same subset as the plain rule for one seed, re-normalised on it as pods does
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    rand = select_samples("random", r, adv, g, 3, generator=gen())
    both = select_samples("pods_random", r, adv, g, 3, generator=gen())
    assert rand.kept_rows.tolist() == both.kept_rows.tolist()
    sub = r[both.kept_rows]
    want = (sub - sub.mean()) / (sub.std() + 1e-4)
    torch.testing.assert_close(both.advantages[both.kept_rows], want.float())
    # renorm_eps: the offset of the re-normalisation
    no_eps = select_samples("pods_random", r, adv, g, 3, generator=gen(), eps=0.0)
    if float(sub.std()) > 0:
        torch.testing.assert_close(
            no_eps.advantages[no_eps.kept_rows], ((sub - sub.mean()) / sub.std()).float()
        )


def test_one_per_group_keeps_the_largest_advantage_of_either_sign():
    """N = 1: a single value has no variance (every choice ties); the intra-group rules keep
    the rollout farthest from its group's mean, not the tie-break's lowest one, so a D3S-I
    step at N = 1 sees positive advantages too. Hand-worked: group 0 has one success of 4
    (keep it, A > 0), group 1 one failure of 4 (keep it, A < 0), group 2 is all equal (the
    lower index)."""
    r = _t([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    g = torch.arange(12) // 4
    adv = compute_advantages(r, g).advantages
    sel = select_samples("d3s_intra", r, adv, g, 1)
    assert sel.kept_rows.tolist() == [1, 6, 8]
    assert sel.advantages[1] > 0 and sel.advantages[6] < 0 and sel.advantages[8] == 0
    # the slow reference: per group, argmax |a - mean(a)|, first index on ties
    for grp in range(3):
        a = adv[g == grp].tolist()
        mean = sum(a) / len(a)
        dev = [abs(x - mean) for x in a]
        assert sel.kept_rows[grp].item() == 4 * grp + dev.index(max(dev))
    # PODS at N = 1 keeps the same rollout; its re-normalised advantage is 0 (no spread)
    pods = select_samples("pods", r, adv, g, 1)
    assert pods.kept_rows.tolist() == [1, 6, 8] and (pods.advantages[pods.sample_keep] == 0).all()


def test_pooled_rule_keeping_one_rollout_keeps_the_largest_advantage():
    """One prompt, N = 1, pooled: again no variance to maximise. Hand-worked: rewards
    0 0 0 1 -> A = -0.5 -0.5 -0.5 1.5 (mean 0): keep the success (row 3), not the
    tie-break's first minimum (row 0); 1 1 1 0 -> keep the failure (row 3, A = -1.5)."""
    g = torch.zeros(4, dtype=torch.long)
    for r, row in (
        (_t([0.0, 0.0, 0.0, 1.0]), 3),
        (_t([1.0, 1.0, 1.0, 0.0]), 3),
        (_t([1.0, 0.0, 1.0, 0.0]), 0),
    ):
        adv = compute_advantages(r, g).advantages
        assert select_samples("d3s_cross", r, adv, g, 1).kept_rows.tolist() == [row]
        assert select_samples("d3s_cross", r, adv, g, 0.25).kept_rows.tolist() == [row]


def test_small_groups_kept_whole():
    r = _t([0.0, 1.0, 0.3])
    g = torch.tensor([5, 5, 6])
    adv = compute_advantages(r, g).advantages
    for rule in ("random", "max_reward", "pods", "d3s_intra"):
        sel = select_samples(rule, r, adv, g, 4, generator=torch.Generator().manual_seed(1))
        assert sel.sample_keep.all(), rule


def test_random_rule_uses_generator():
    torch.manual_seed(0)
    r = torch.rand(60, dtype=torch.float64)
    g = torch.arange(60) % 5
    adv = compute_advantages(r, g).advantages

    def pick(seed):
        return select_samples(
            "random", r, adv, g, 4, generator=torch.Generator().manual_seed(seed)
        ).sample_keep

    a = pick(123)
    assert torch.equal(a, pick(123))
    assert any(not torch.equal(a, pick(s)) for s in range(5))
    counts = torch.bincount(g[a], minlength=5)
    assert counts.tolist() == [4] * 5
    # without a generator it still keeps N per group
    sel = select_samples("random", r, adv, g, 0.5, generator=None)
    assert torch.bincount(g[sel.sample_keep], minlength=5).tolist() == [6] * 5


def test_random_rule_is_roughly_uniform():
    r = torch.zeros(4, dtype=torch.float64)
    g = torch.zeros(4, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    hits = torch.zeros(4)
    for _ in range(400):
        hits += select_samples("random", r, r, g, 1, generator=gen).sample_keep.float()
    assert hits.min() > 60 and hits.max() < 140


def test_registry_contents():
    assert set(SAMPLE_SELECTORS.names()) == {
        "all",
        "random",
        "max_reward",
        "pods",
        "pods_random",
        "pods_max_reward",
        "d3s_intra",
        "d3s_cross",
    }


# ---------------------------------------------------------------------------- papers' claims


def test_papers_binary_g4_two_correct_n3():
    """D3S (arXiv 2509.22115), its lemma that a kept subset with Var(A) >= 1 always exists:
    it holds with unbiased variance throughout; with population variance throughout, G=4
    with 2 correct and N=3 gives 8/9 = 0.889."""
    r = _t([1.0, 1.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 0, 0])
    adv_u = compute_advantages(r, g, eps=0.0, unbiased=True).advantages
    sel_u = select_samples("d3s_intra", r, adv_u, g, 3)
    assert sel_u.n_kept == 3
    assert kept_advantage_variance(
        sel_u.advantages, sel_u.sample_keep, unbiased=True
    ) == pytest.approx(1.0, rel=1e-6)

    adv_p = compute_advantages(r, g, eps=0.0, unbiased=False).advantages
    sel_p = select_samples("d3s_intra", r, adv_p, g, 3)
    var_p = kept_advantage_variance(sel_p.advantages, sel_p.sample_keep, unbiased=False)
    assert var_p == pytest.approx(8 / 9, rel=1e-6)
    assert var_p < 1.0


@settings(max_examples=60, deadline=None)
@given(
    rewards=st.lists(st.integers(-20, 20).map(lambda x: x / 4), min_size=2, max_size=12),
    m_frac=st.floats(0.0, 1.0),
)
def test_unbiased_kept_variance_at_least_one(rewards, m_frac):
    """The mean of the unbiased variance over all m-subsets is the group's unbiased
    variance (= 1 after eps=0 normalisation), so the max-variance subset reaches >= 1."""
    if len(set(rewards)) == 1:
        return
    n = len(rewards)
    m = max(2, min(n, round(m_frac * n)))
    r, g = _t(rewards), torch.zeros(n, dtype=torch.long)
    adv = compute_advantages(r, g, eps=0.0, unbiased=True).advantages
    sel = select_samples("d3s_intra", r, adv, g, m)
    assert kept_advantage_variance(sel.advantages, sel.sample_keep) >= 1.0 - 1e-5


def test_metric_helpers_hand_worked():
    adv = torch.tensor([1.0, -1.0, 0.0, 3.0])
    keep = torch.tensor([True, True, True, False])
    assert kept_advantage_variance(adv, keep) == pytest.approx(1.0)
    assert kept_advantage_variance(adv, keep, unbiased=False) == pytest.approx(2 / 3)
    assert share_nonzero_advantage(adv, keep) == pytest.approx(2 / 3)
    # dropped rows do not count, even when non-finite
    adv_nan = torch.tensor([1.0, -1.0, float("nan")])
    assert kept_advantage_variance(adv_nan, torch.tensor([True, True, False])) == pytest.approx(2.0)
    assert (
        kept_advantage_variance(adv, torch.tensor([False, False, False, True]), unbiased=False)
        == 0.0
    )


# ---------------------------------------------------------------------------- validation

R = _t([0.0, 1.0, 1.0, 0.0])
A = _t([-1.0, 1.0, 1.0, -1.0])
G = torch.tensor([0, 0, 1, 1])
NAN = _t([0.0, float("nan"), 1.0, 0.0])
INF = _t([0.0, float("inf"), 1.0, 0.0])


@pytest.mark.parametrize(
    "values, m, needle",
    [
        (NAN, 2, "values"),
        (INF, 2, "values"),
        (_t([]), 1, "values"),
        (_t([[1.0, 2.0]]), 1, "values"),
        ([1.0, 2.0], 1, "values"),
        (torch.tensor([1 + 1j, 2 + 0j]), 1, "values"),
        (R, 0, "m must"),
        (R, -1, "m must"),
        (R, 5, "m must"),
        (R, 2.0, "m must"),
        (R, True, "m must"),
    ],
)
def test_max_variance_subset_errors(values, m, needle):
    with pytest.raises(ValueError, match=needle):
        max_variance_subset(values, m)


@pytest.mark.parametrize(
    "values, m, needle",
    [
        (R, 2, "values"),
        (R.view(2, 2), 3, "m must"),
        (R.view(2, 2), 0, "m must"),
        (NAN.view(2, 2), 1, "values"),
    ],
)
def test_max_variance_mask_errors(values, m, needle):
    with pytest.raises(ValueError, match=needle):
        max_variance_mask(values, m)


@pytest.mark.parametrize("n_keep", [0, -3, 1.5, 0.0, -0.5, float("nan"), True, "4", None])
def test_resolve_n_keep_errors(n_keep):
    with pytest.raises(ValueError, match="n_keep"):
        resolve_n_keep(n_keep, 8)


@pytest.mark.parametrize("group_size", [0, -1, 2.0, True])
def test_resolve_n_keep_group_size_errors(group_size):
    with pytest.raises(ValueError, match="group_size"):
        resolve_n_keep(2, group_size)


@pytest.mark.parametrize("rule", sorted(SAMPLE_SELECTORS.names()))
@pytest.mark.parametrize(
    "args, needle",
    [
        ((NAN, A, G, 2), "rewards"),
        ((INF, A, G, 2), "rewards"),
        ((R, NAN, G, 2), "advantages"),
        ((R, A[:3], G, 2), "advantages"),
        ((R, A, G[:3], 2), "group_ids"),
        ((R, A, G.double(), 2), "group_ids"),
        ((_t([]), _t([]), torch.tensor([], dtype=torch.long), 1), "rewards"),
        ((R, A, G, 0), "n_keep"),
        ((R, A, G, 1.5), "n_keep"),
        ((R, A, G, 0.0), "n_keep"),
        ((R, A, torch.tensor([0, 0, 1, 1], device="meta"), 2), "group_ids"),
    ],
)
def test_select_samples_errors(rule, args, needle):
    with pytest.raises(ValueError, match=needle):
        select_samples(rule, *args, generator=torch.Generator().manual_seed(0))


def test_unknown_rule_and_bad_pods_eps():
    with pytest.raises(ValueError, match="sample selection rule"):
        select_samples("best", R, A, G, 2)
    with pytest.raises(ValueError, match="eps"):
        select_samples("pods", R, A, G, 2, eps=-1e-4)


@pytest.mark.parametrize(
    "adv, keep, kw, needle",
    [
        (A, torch.tensor([1, 1, 0, 0]), {}, "sample_keep"),
        (A, torch.tensor([True, True]), {}, "sample_keep"),
        (A, torch.tensor([True, False, False, False]), {}, "sample_keep"),
        (A, torch.zeros(4, dtype=torch.bool), {"unbiased": False}, "sample_keep"),
        (NAN, torch.ones(4, dtype=torch.bool), {}, "advantages"),
        (A.view(2, 2), torch.ones(2, 2, dtype=torch.bool), {}, "advantages"),
        (A, torch.ones(4, dtype=torch.bool, device="meta"), {}, "sample_keep"),
    ],
)
def test_kept_advantage_variance_errors(adv, keep, kw, needle):
    with pytest.raises(ValueError, match=needle):
        kept_advantage_variance(adv, keep, **kw)


def test_share_nonzero_errors():
    with pytest.raises(ValueError, match="sample_keep"):
        share_nonzero_advantage(A, torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="sample_keep"):
        share_nonzero_advantage(A, torch.ones(4, dtype=torch.long))
