"""core.micro_batches: the token-budget partition against a slow obvious reference, a
hand-worked case, and its properties (every row exactly once, the budget kept except by a
single oversize row)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_d3s.core.micro_batches import (
    fixed_micro_batches,
    plan_rows,
    token_budget_micro_batches,
)


def padded_tokens(lengths: torch.Tensor, plan) -> int:
    """Positions a plan feeds the model: sum over micro-batches of rows x longest row."""
    return int(sum(len(r) * int(lengths[r].max()) for r in plan if len(r)))


def _reference(lengths, budget):
    """The obvious O(B^2) version: repeatedly take the longest remaining row (lowest index
    on ties), then keep adding the next longest while the block rows x first length fits."""
    left = list(range(len(lengths)))
    out = []
    while left:
        left.sort(key=lambda i: (-lengths[i], i))
        mb = [left.pop(0)]
        width = max(lengths[mb[0]], 1)
        while left and (len(mb) + 1) * width <= budget:
            mb.append(left.pop(0))
        out.append(mb)
    return out


def test_hand_worked_case():
    # lengths:   row 0  1  2  3  4  5   budget 12
    # sorted:    4(9) 1(6) 5(4) 3(3) 0(2) 2(2)
    # mb 1: row 4 alone (2 x 9 = 18 > 12); mb 2: rows 1, 5 (2 x 6 = 12);
    # mb 3: rows 3, 0, 2, (3 x 3 = 9; a 4th row would be 12 but none is left)
    lengths = torch.tensor([2, 6, 2, 3, 9, 4])
    plan = token_budget_micro_batches(lengths, 12)
    assert [r.tolist() for r in plan] == [[4], [1, 5], [3, 0, 2]]
    assert padded_tokens(lengths, plan) == 9 + 12 + 9
    # the fixed plan of 2 rows pays more: (6 + 6) + (3 + 3) + (9 + 9)
    assert padded_tokens(lengths, fixed_micro_batches(6, 2)) == 36


def test_oversize_row_gets_its_own_micro_batch():
    plan = token_budget_micro_batches(torch.tensor([3, 50, 3, 40]), 30)
    assert [r.tolist() for r in plan] == [[1], [3], [0, 2]]


def test_plan_rows_falls_back_to_fixed_size():
    lengths = torch.tensor([5, 1, 7, 2, 2])
    for none in (None, 0):
        assert [r.tolist() for r in plan_rows(lengths, 2, none)] == [[0, 1], [2, 3], [4]]
    assert [r.tolist() for r in plan_rows(lengths, 2, 8)] == [[2], [0], [3, 4, 1]]
    assert plan_rows(torch.zeros(0, dtype=torch.long), 2, 8) == []
    assert fixed_micro_batches(0, 3) == []


def test_bad_input_is_refused():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            token_budget_micro_batches(torch.tensor([1, 2]), bad)
        with pytest.raises(ValueError, match="micro_batch_size"):
            fixed_micro_batches(3, bad)
    with pytest.raises(ValueError, match=">= 0"):
        token_budget_micro_batches(torch.tensor([1, -2]), 4)
    with pytest.raises(ValueError, match=r"\[B\]"):
        plan_rows(torch.ones(2, 2, dtype=torch.long), 2, 4)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 64), min_size=0, max_size=40),
    budget=st.integers(1, 200),
)
def test_partition_properties(lengths, budget):
    t = torch.tensor(lengths, dtype=torch.long)
    plan = token_budget_micro_batches(t, budget)
    # equal to the obvious reference
    assert [r.tolist() for r in plan] == _reference(lengths, budget)
    # every row exactly once
    rows = sorted(i for r in plan for i in r.tolist())
    assert rows == list(range(len(lengths)))
    for r in plan:
        assert len(r) >= 1
        block = len(r) * max(int(t[r].max()), 1)
        # the budget holds, or the micro-batch is one row that alone exceeds it
        assert block <= budget or (len(r) == 1 and int(t[r[0]]) > budget)
        # the first row is the longest (it sets the width)
        assert int(t[r[0]]) == int(t[r].max())
    # what the plan feeds covers every real token
    assert padded_tokens(t, plan) >= int(t.sum())


def test_row_lengths():
    from nemo_d3s.core.micro_batches import row_lengths

    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]]).bool()
    assert row_lengths(mask).tolist() == [2, 0, 4, 3]
    assert row_lengths(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]
