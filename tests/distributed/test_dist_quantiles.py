"""Exact quantiles over ranks (distributed/quantiles.py) against a slow obvious reference:
every rank's values in one Python list, sorted, the element at floor(q (N - 1)); one launch
of 3 gloo ranks, cases with ties, signed zeros, extremes, an empty rank and no values."""

from __future__ import annotations

import math

import pytest
import torch

from _launch import run_ranks
from nemo_d3s.distributed.quantiles import global_quantiles

pytestmark = pytest.mark.distributed

QS = [0.0, 0.05, 0.5, 0.95, 1.0]
CASES = ["random", "ties", "extremes", "empty_rank", "nobody"]


def _values(case, rank):
    g = torch.Generator().manual_seed(31 * rank + CASES.index(case))
    v = torch.randn(5 + 4 * rank, generator=g) * 3
    if case == "ties":
        v = torch.randint(-2, 3, (7 + rank,), generator=g).float()
    elif case == "extremes":
        pool = torch.tensor([0.0, -0.0, 3e38, -3e38, 1e-45, -1e-45, 2.5, -2.5])
        v = pool[torch.randint(0, pool.numel(), (6 + rank,), generator=g)]
    elif case == "empty_rank" and rank == 1:
        v = v[:0]
    elif case == "nobody":
        v = v[:0]
    return v


def _reference(values, qs):
    xs = sorted(float(x) for x in values)
    if not xs:
        return [math.nan] * len(qs)
    return [xs[int(math.floor(q * (len(xs) - 1)))] for q in qs]


def _rank(rank):
    import torch.distributed as dist

    return {c: global_quantiles(_values(c, rank), QS, dist.group.WORLD) for c in CASES}


def _same(a, b):
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def test_quantiles_over_three_ranks_equal_the_sorted_reference():
    results = run_ranks(_rank, 3, megatron=False)
    for case in CASES:
        everyone = torch.cat([_values(case, r) for r in range(3)])
        want = _reference(everyone, QS)
        for r in range(3):
            assert _same(results[r][case], want), (case, r, results[r][case], want)
        if everyone.numel():  # one process on the concatenation: the same numbers
            assert _same(global_quantiles(everyone, QS, None), want)
            lower = torch.quantile(everyone, torch.tensor(QS), interpolation="lower").tolist()
            assert _same(lower, want)


def test_a_non_finite_value_is_an_error_and_quantiles_outside_0_1_are_refused():
    with pytest.raises(ValueError, match="finite"):
        global_quantiles(torch.tensor([1.0, float("inf")]), [0.5], None)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        global_quantiles(torch.tensor([1.0]), [1.5], None)
