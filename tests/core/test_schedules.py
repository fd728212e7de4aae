"""(N, K) schedules: endpoints, monotonicity, milestones, the D3S paper's example, errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_d3s.core.schedules import SCHEDULES, DynamicSchedule, schedule_value

PROGRESS = [i / 20 for i in range(21)]


def test_registry_contents():
    assert set(SCHEDULES.names()) == {"linear", "cosine", "constant", "step"}


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("start, end", [(8.0, 32.0), (0.2, 0.05), (0.05, 0.2), (3.0, 3.0)])
def test_endpoints_and_monotone(kind, start, end):
    vals = [schedule_value(kind, p, start, end) for p in PROGRESS]
    assert vals[0] == start and vals[-1] == end
    sign = 1 if end >= start else -1
    assert all(sign * (b - a) >= 0 for a, b in zip(vals, vals[1:]))
    assert all(min(start, end) <= v <= max(start, end) for v in vals)


@settings(max_examples=100, deadline=None)
@given(
    p=st.floats(0, 1),
    q=st.floats(0, 1),
    start=st.floats(-100, 100),
    end=st.floats(-100, 100),
    kind=st.sampled_from(["linear", "cosine"]),
)
def test_monotone_property(p, q, start, end, kind):
    lo, hi = min(p, q), max(p, q)
    a, b = schedule_value(kind, lo, start, end), schedule_value(kind, hi, start, end)
    tol = 1e-9 * (abs(start) + abs(end) + 1)
    assert (b - a) * (1 if end >= start else -1) >= -tol


def test_linear_and_cosine_midpoints():
    assert schedule_value("linear", 0.25, 0.0, 4.0) == 1.0
    assert schedule_value("cosine", 0.5, 0.0, 4.0) == pytest.approx(2.0)
    # cosine is slower than linear near the start
    assert schedule_value("cosine", 0.1, 0.0, 1.0) == pytest.approx(
        (1 - math.cos(0.1 * math.pi)) / 2
    )
    assert schedule_value("cosine", 0.1, 0.0, 1.0) < schedule_value("linear", 0.1, 0.0, 1.0)


def test_constant():
    assert [schedule_value("constant", p, 5.0, 9.0) for p in (0.0, 0.5, 1.0)] == [5.0, 5.0, 5.0]


def test_step_milestones():
    kw = {"milestones": [0.25, 0.5, 0.75]}
    got = [
        schedule_value("step", p, 8.0, 32.0, **kw)
        for p in (0.0, 0.2, 0.25, 0.49, 0.5, 0.74, 0.75, 1.0)
    ]
    assert got == [8.0, 8.0, 16.0, 16.0, 24.0, 24.0, 32.0, 32.0]
    # default: one jump at half-way
    assert schedule_value("step", 0.49, 1.0, 2.0) == 1.0
    assert schedule_value("step", 0.5, 1.0, 2.0) == 2.0
    # the last milestone lands exactly on end
    assert schedule_value("step", 0.9, 0.05, 0.2, milestones=[0.3, 0.6, 0.9]) == 0.2


def test_paper_example_n_8_to_32_k_5_to_20_percent():
    s = DynamicSchedule("linear", 8, 32, 0.05, 0.2)
    assert s.at(0.0) == (8, 0.05)
    assert s.at(1.0) == (32, 0.2)
    n, k = s.at(0.5)
    assert n == 20 and isinstance(n, int) and k == pytest.approx(0.125)
    n, k = s.at(0.25)
    assert n == 14 and k == pytest.approx(0.0875)
    ns = [s.at(p)[0] for p in PROGRESS]
    assert ns == sorted(ns) and all(isinstance(x, int) for x in ns)


def test_int_counts_round_half_up():
    s = DynamicSchedule("linear", 1, 2, 0.5, 0.5)
    assert s.at(0.5) == (2, 0.5)  # 1.5 -> 2
    assert s.at(0.49)[0] == 1


def test_fraction_n_stays_float():
    s = DynamicSchedule("linear", 0.125, 0.5, 0.05, 0.2)
    n, k = s.at(0.5)
    assert isinstance(n, float) and n == pytest.approx(0.3125)
    assert DynamicSchedule("constant", 1.0, 1.0, 1.0, 1.0).at(0.37) == (1.0, 1.0)
    # a + b = 1 interpolation never leaves (0, 1] through rounding
    s1 = DynamicSchedule("linear", 1.0, 1.0, 1.0, 1.0)
    assert all(s1.at(p) == (1.0, 1.0) for p in PROGRESS)


def test_dynamic_step_and_cosine():
    s = DynamicSchedule("step", 8, 32, 0.05, 0.2, {"milestones": [0.5]})
    assert s.at(0.4) == (8, 0.05) and s.at(0.5) == (32, 0.2)
    c = DynamicSchedule("cosine", 8, 32, 0.05, 0.2)
    assert c.at(0.0) == (8, 0.05) and c.at(1.0) == (32, 0.2)
    assert c.at(0.5)[0] == 20


def test_defaults_keep_everything():
    assert DynamicSchedule().at(0.3) == (1.0, 1.0)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "step"])
@pytest.mark.parametrize("progress", [-0.01, 1.01, float("nan"), float("inf"), "0.5", None, True])
def test_progress_out_of_range(kind, progress):
    with pytest.raises(ValueError, match="progress"):
        schedule_value(kind, progress, 0.0, 1.0)


@pytest.mark.parametrize("progress", [-0.1, 1.5, float("nan")])
def test_dynamic_progress_out_of_range(progress):
    with pytest.raises(ValueError, match="progress"):
        DynamicSchedule("linear", 8, 32, 0.05, 0.2).at(progress)


@pytest.mark.parametrize(
    "args, needle",
    [
        ((float("nan"), 1.0), "start"),
        ((0.0, float("inf")), "end"),
        (("a", 1.0), "start"),
    ],
)
def test_endpoint_errors(args, needle):
    with pytest.raises(ValueError, match=needle):
        schedule_value("linear", 0.5, *args)


@pytest.mark.parametrize("milestones", [[], [0.5, 0.2], [1.5], [-0.1]])
def test_step_milestone_errors(milestones):
    with pytest.raises(ValueError, match="milestones"):
        schedule_value("step", 0.5, 0.0, 1.0, milestones=milestones)


def test_unexpected_kwargs():
    with pytest.raises(ValueError, match="kwargs"):
        schedule_value("linear", 0.5, 0.0, 1.0, milestones=[0.5])
    with pytest.raises(ValueError, match="kwargs"):
        schedule_value("step", 0.5, 0.0, 1.0, milestone=[0.5])
    with pytest.raises(ValueError, match="kwargs"):
        DynamicSchedule("cosine", 8, 32, 0.05, 0.2, {"milestones": [0.5]})


def test_unknown_schedule():
    with pytest.raises(ValueError, match="schedule"):
        DynamicSchedule("exponential", 8, 32, 0.05, 0.2)
    with pytest.raises(ValueError, match="schedule"):
        schedule_value("exponential", 0.5, 0.0, 1.0)


@pytest.mark.parametrize(
    "args, needle",
    [
        ((8, 32.0, 0.05, 0.2), "n_init and n_final"),
        ((0.1, 32, 0.05, 0.2), "n_init and n_final"),
        ((0, 32, 0.05, 0.2), "n_init"),
        ((8, -1, 0.05, 0.2), "n_final"),
        ((1.5, 0.5, 0.05, 0.2), "n_init"),
        ((0.5, 0.0, 0.05, 0.2), "n_final"),
        ((True, 4, 0.05, 0.2), "n_init"),
        (("8", 4, 0.05, 0.2), "n_init"),
        ((8, 32, 0.0, 0.2), "k_init"),
        ((8, 32, 0.05, 1.2), "k_final"),
        ((8, 32, float("nan"), 0.2), "k_init"),
        ((8, 32, None, 0.2), "k_init"),
    ],
)
def test_dynamic_schedule_construction_errors(args, needle):
    with pytest.raises(ValueError, match=needle):
        DynamicSchedule("linear", *args)
