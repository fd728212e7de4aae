"""Group advantages: hand-worked cases, a per-group loop reference, validation messages."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_d3s.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_buckets,
    group_index,
)


def _t(xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


# ---------------------------------------------------------------------------- group_index


def test_group_index_first_appearance_order():
    ids = torch.tensor([42, -7, 42, 1000000000000, -7, 3])
    index, n = group_index(ids)
    assert n == 4
    assert index.tolist() == [0, 1, 0, 2, 1, 3]
    assert index.dtype == torch.long


def test_group_index_int32_ids():
    index, n = group_index(torch.tensor([5, 5, 2], dtype=torch.int32))
    assert (index.tolist(), n) == ([0, 0, 1], 2)


def test_group_buckets_layout():
    ids = torch.tensor([3, 1, 3, 2, 1, 3, 9, 2])
    index, n = group_index(ids)  # groups: 3 -> 0, 1 -> 1, 2 -> 2, 9 -> 3
    buckets = group_buckets(index, n)
    assert [g for g, _, _ in buckets] == [1, 2, 3]
    as_lists = {g: (groups.tolist(), layout.tolist()) for g, groups, layout in buckets}
    assert as_lists[1] == ([3], [[6]])
    assert as_lists[2] == ([1, 2], [[1, 4], [3, 7]])
    assert as_lists[3] == ([0], [[0, 2, 5]])


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(-5, 5), min_size=1, max_size=40))
def test_group_buckets_cover_every_sample_once(ids):
    index, n = group_index(torch.tensor(ids))
    seen = []
    for g_size, groups, layout in group_buckets(index, n):
        assert layout.shape == (groups.numel(), g_size)
        for gi, row in zip(groups.tolist(), layout.tolist()):
            assert row == sorted(row) and all(index[j].item() == gi for j in row)
            assert len(row) == ids.count(ids[row[0]])
        seen += layout.flatten().tolist()
    assert sorted(seen) == list(range(len(ids)))


# ---------------------------------------------------------------------------- hand-worked


def test_grpo_hand_worked_unbiased_and_biased():
    # mean 0.5; unbiased std sqrt(1/3); biased std 0.5
    r = _t([1.0, 0.0, 1.0, 0.0])
    g = torch.tensor([9, 9, 9, 9])
    a = compute_advantages(r, g, "grpo", eps=0.0, unbiased=True).advantages
    torch.testing.assert_close(a, _t([1, -1, 1, -1]) * 0.5 / math.sqrt(1 / 3))
    b = compute_advantages(r, g, "grpo", eps=0.0, unbiased=False).advantages
    torch.testing.assert_close(b, _t([1.0, -1.0, 1.0, -1.0]))
    # eps sits in the denominator next to std
    c = compute_advantages(r, g, "grpo", eps=0.5, unbiased=False).advantages
    torch.testing.assert_close(c, _t([0.5, -0.5, 0.5, -0.5]))


def test_grpo_continuous_hand_worked():
    # r = [1, 2, 6]: mean 3, deviations [-2, -1, 3], unbiased var 14/2 = 7
    a = compute_advantages(_t([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0]), eps=0.0).advantages
    torch.testing.assert_close(a, _t([-2.0, -1.0, 3.0]) / math.sqrt(7.0))
    assert a.dtype == torch.float32


def test_dr_grpo_hand_worked():
    a = compute_advantages(
        _t([1.0, 2.0, 6.0, 4.0, 0.0]), torch.tensor([3, 3, 3, 8, 8]), "dr_grpo"
    ).advantages
    torch.testing.assert_close(a, _t([-2.0, -1.0, 3.0, 2.0, -2.0]))


def test_rloo_hand_worked():
    # r_i - mean of the others: 1 - (2+6)/2 = -3; 2 - 3.5 = -1.5; 6 - 1.5 = 4.5
    a = compute_advantages(_t([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0]), "rloo").advantages
    torch.testing.assert_close(a, _t([-3.0, -1.5, 4.5]))


def test_unequal_group_sizes_unsorted_ids():
    # group 7: [0, 1] at positions 0, 3; group -1: [2, 4, 9] at 1, 2, 4
    r = _t([0.0, 2.0, 4.0, 1.0, 9.0])
    g = torch.tensor([7, -1, -1, 7, -1])
    res = compute_advantages(r, g, "dr_grpo")
    torch.testing.assert_close(res.advantages, _t([-0.5, -3.0, -1.0, 0.5, 4.0]))
    assert res.group_index.tolist() == [0, 1, 1, 0, 1]
    assert res.n_groups == 2 and res.n_degenerate == 0
    grpo = compute_advantages(r, g, "grpo", eps=0.0).advantages
    # group -1: deviations [-3, -1, 4], unbiased var 26/2 = 13; group 7: std sqrt(0.5)
    s7, s1 = math.sqrt(0.5), math.sqrt(13)
    expected = _t([-0.5 / s7, -3 / s1, -1 / s1, 0.5 / s7, 4 / s1])
    torch.testing.assert_close(grpo, expected)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_degenerate_groups_zero_and_counted(estimator):
    # 0.1 x 3 does not average back to 0.1 exactly; the zeros must still be exact.
    r = _t([0.1, 0.1, 0.1, 1.0, 0.0, 5.0, 7.0, 7.0], dtype=torch.float64)
    g = torch.tensor([1, 1, 1, 2, 2, 3, 4, 4])  # group 3 has G = 1
    res = compute_advantages(r, g, estimator)
    assert res.degenerate_groups.tolist() == [True, False, True, True]
    assert res.n_degenerate == 3 and res.n_groups == 4
    adv = res.advantages
    assert (adv[[0, 1, 2, 5, 6, 7]] == 0).all()
    assert (adv[[3, 4]] != 0).all()


def test_single_rollout_groups_biased_std():
    res = compute_advantages(_t([3.0, 4.0]), torch.tensor([0, 1]), unbiased=False)
    assert res.advantages.tolist() == [0.0, 0.0]
    assert res.n_degenerate == 2


def test_int_rewards_accepted():
    a = compute_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), "dr_grpo").advantages
    torch.testing.assert_close(a, _t([0.5, -0.5]))


def test_registry_names_and_direct_call_on_raw_ids():
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {"grpo", "dr_grpo", "rloo"}
    fn = ADVANTAGE_ESTIMATORS.get("rloo")
    out = fn(_t([1.0, 3.0, 5.0, 5.0]), torch.tensor([10, 20, 10, 20]), eps=1e-6, unbiased=True)
    torch.testing.assert_close(out, _t([-4.0, -2.0, 4.0, 2.0]))


# ---------------------------------------------------------------------------- reference


def _reference(r, g, estimator, eps, unbiased):
    """Slow obvious per-group loop."""
    out = [0.0] * len(r)
    for gid in dict.fromkeys(g):
        idx = [i for i, x in enumerate(g) if x == gid]
        vals = [r[i] for i in idx]
        n = len(vals)
        if n == 1 or max(vals) == min(vals):
            continue
        mean = sum(vals) / n
        for i in idx:
            if estimator == "grpo":
                var = sum((v - mean) ** 2 for v in vals) / (n - 1 if unbiased else n)
                out[i] = (r[i] - mean) / (math.sqrt(var) + eps)
            elif estimator == "dr_grpo":
                out[i] = r[i] - mean
            else:
                out[i] = r[i] - (sum(vals) - r[i]) / (n - 1)
    return out


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        # Milli-unit floats: well-conditioned (no subnormal spreads) yet dense in ties.
        st.tuples(
            st.integers(-3, 3),
            st.sampled_from([0.0, 1.0, 0.5]) | st.integers(-9999, 9999).map(lambda x: x / 1000),
        ),
        min_size=1,
        max_size=30,
    ),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    unbiased=st.booleans(),
    eps=st.sampled_from([0.0, 1e-6, 1e-2]),
)
def test_matches_per_group_loop(data, estimator, unbiased, eps):
    g = [d[0] for d in data]
    r = [d[1] for d in data]
    res = compute_advantages(
        _t(r, torch.float64), torch.tensor(g), estimator, eps=eps, unbiased=unbiased
    )
    ref = _reference(r, g, estimator, eps, unbiased)
    torch.testing.assert_close(
        res.advantages, torch.tensor(ref, dtype=torch.float32), rtol=1e-5, atol=1e-5
    )
    first_seen = list(dict.fromkeys(g))
    assert res.group_index.tolist() == [first_seen.index(x) for x in g]
    assert res.n_degenerate == sum(
        1 for gid in first_seen if len({r[i] for i, x in enumerate(g) if x == gid}) == 1
    )


def test_deterministic():
    torch.manual_seed(0)
    r = torch.rand(64)
    g = torch.randint(0, 9, (64,))
    a = compute_advantages(r, g).advantages
    b = compute_advantages(r, g).advantages
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "rewards, group_ids, kw, needle",
    [
        (_t([1.0, float("nan")]), torch.tensor([0, 0]), {}, "rewards"),
        (_t([1.0, float("inf")]), torch.tensor([0, 0]), {}, "rewards"),
        (_t([]), torch.tensor([], dtype=torch.long), {}, "rewards"),
        (_t([[1.0, 2.0]]), torch.tensor([[0, 0]]), {}, "rewards"),
        (_t([1.0, 2.0]), torch.tensor([0, 0, 1]), {}, "group_ids"),
        (_t([1.0, 2.0]), _t([0.0, 0.0]), {}, "group_ids"),
        (_t([1.0, 2.0]), torch.tensor([0, 0]), {"eps": -1.0}, "eps"),
        (_t([1.0, 2.0]), torch.tensor([0, 0]), {"eps": float("nan")}, "eps"),
        (_t([1.0, 2.0]), torch.tensor([0, 0]), {"estimator": "ppo"}, "advantage estimator"),
        ([1.0, 2.0], torch.tensor([0, 0]), {}, "rewards"),
    ],
)
def test_value_errors_name_argument(rewards, group_ids, kw, needle):
    with pytest.raises(ValueError, match=needle):
        compute_advantages(rewards, group_ids, **kw)


def test_group_index_errors():
    with pytest.raises(ValueError, match="group_ids"):
        group_index(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids"):
        group_index(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="group_ids"):
        group_index([0, 1])


def test_device_mismatch_message():
    meta = torch.tensor([0, 0], device="meta")
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(_t([1.0, 2.0]), meta)
