"""core.packing: the first-fit-decreasing plan against a slow obvious reference, a
hand-worked case, and its properties (every real token once, rows restored in order, the
budget kept except by a single oversize row, positions restarting per row)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_d3s.core.packing import empty_pack, pack_micro_batches, slot_lengths


def _reference_plan(lengths, budget, multiple=1):
    """First-fit decreasing for the number of packs n, then the rows longest first (row
    order on ties) each into the least loaded of n packs (lowest index on ties), kept when
    no shared pack is over the budget and none above first-fit's fullest."""
    slots = [-(-max(n, 1) // multiple) * multiple for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-slots[i], i))
    packs = []  # [rows, used, capacity]
    for i in order:
        for p in packs:
            if p[1] + slots[i] <= p[2]:
                p[0].append(i)
                p[1] += slots[i]
                break
        else:
            packs.append([[i], slots[i], max(budget, slots[i])])
    spread = [[] for _ in packs]
    for i in order:
        k = min(range(len(spread)), key=lambda k: (sum(slots[r] for r in spread[k]), k))
        spread[k].append(i)
    loads = [sum(slots[r] for r in m) for m in spread]
    ok = all(n <= budget for n, m in zip(loads, spread) if len(m) > 1)
    if ok and max(loads, default=0) <= max((p[1] for p in packs), default=0):
        return spread, slots
    return [p[0] for p in packs], slots


def _reference_pack(x, rows, slots, width):
    out = [0] * width
    pos = 0
    for r in rows:
        for c in range(int(x.lengths[r])):
            out[pos + c] = int(x.ids[r, c])
        pos += slots[r]
    return out


class _Batch:
    def __init__(self, lengths, S):
        self.lengths = torch.tensor(lengths, dtype=torch.long)
        self.ids = torch.arange(1, len(lengths) * S + 1).view(len(lengths), S)
        cols = torch.arange(S).unsqueeze(0)
        self.ids = self.ids * (cols < self.lengths.unsqueeze(1))  # right padding = 0


def test_hand_worked_case():
    # lengths: row 0: 3, row 1: 5, row 2: 2, row 3: 4; budget 8
    # first-fit decreasing: 1 (5) opens A, 3 (4) opens B, 0 (3) fills A, 2 (2) goes to B:
    # two packs, A = 8, B = 6. Spread over two packs, least loaded first: 1 -> A (5),
    # 3 -> B (4), 0 -> B (7), 2 -> A (7): 7 and 7, fuller than neither
    lengths = torch.tensor([3, 5, 2, 4])
    packs = pack_micro_batches(lengths, 8)
    assert [p.rows.tolist() for p in packs] == [[1, 2], [3, 0]]
    assert [p.cu_seqlens.tolist() for p in packs] == [[0, 5, 7], [0, 4, 7]]
    assert [p.width for p in packs] == [7, 7] and [p.max_seqlen for p in packs] == [5, 4]
    a = packs[1]
    assert a.position_ids().tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert a.segment_ids().tolist() == [0, 0, 0, 0, 1, 1, 1]
    ids = torch.tensor(
        [[11, 12, 13, 0, 0], [21, 22, 23, 24, 25], [31, 32, 0, 0, 0], [41] * 4 + [0]]
    )
    assert a.pack(ids).tolist() == [41, 41, 41, 41, 11, 12, 13]
    # token-aligned values of the pack: position p holds 100 + p; position 4 (row 0's
    # first token, scored from row 3's last logits) must not come back
    y = 100.0 + torch.arange(7.0)
    assert a.unpack(y, 5).tolist() == [
        [0.0, 101.0, 102.0, 103.0, 0.0],
        [0.0, 105.0, 106.0, 0.0, 0.0],
    ]
    wide = packs[0].widen(10)  # the last slot takes the tail padding
    assert wide.cu_seqlens.tolist() == [0, 5, 10] and wide.position_ids()[-1] == 4
    assert wide.pack(ids).tolist() == [21, 22, 23, 24, 25, 31, 32, 0, 0, 0]


def test_slots_rounded_to_a_multiple_and_oversize_rows_alone():
    lengths = torch.tensor([3, 20, 0, 5])
    assert slot_lengths(lengths, 4).tolist() == [4, 20, 4, 8]
    # row 2 (empty) still gets a slot of 4; row 1 (20) is over the budget: a pack alone
    packs = pack_micro_batches(lengths, 16, seq_multiple=4)
    assert [p.rows.tolist() for p in packs] == [[1], [3, 0, 2]]
    packs = pack_micro_batches(lengths, 12, seq_multiple=4)
    assert [p.rows.tolist() for p in packs] == [[1], [3], [0, 2]]
    assert [p.width for p in packs] == [20, 8, 8]


def test_spreading_keeps_the_budget():
    # first-fit decreasing: [4, 4] and [3, 3, 2], 8 each; least loaded first would put the
    # 2 on a 4 + 3 pack (9 > 8): the first-fit packs are kept
    packs = pack_micro_batches(torch.tensor([4, 4, 3, 3, 2]), 8)
    assert [p.rows.tolist() for p in packs] == [[0, 1], [2, 3, 4]]
    assert [p.width for p in packs] == [8, 8]


def test_empty_pack_and_bad_inputs():
    e = empty_pack(6)
    assert e.width == 6 and e.position_ids().tolist() == list(range(6))
    assert e.unpack(torch.ones(6), 4).shape == (0, 4)
    assert pack_micro_batches(torch.zeros(0, dtype=torch.long), 4) == []
    with pytest.raises(ValueError, match="max_tokens"):
        pack_micro_batches(torch.tensor([1]), 0)
    with pytest.raises(ValueError, match=">= 0"):
        pack_micro_batches(torch.tensor([-1]), 4)
    with pytest.raises(ValueError, match="content"):
        pack_micro_batches(torch.tensor([3, 2]), 8)[0].widen(4)


def test_tokens_from_a_column_per_row():
    p = pack_micro_batches(torch.tensor([3, 4]), 8)[0]  # rows [1, 0]: slots [0, 4), [4, 7)
    r, c, pos = p.tokens(torch.tensor([2, 1]))  # row 1 from column 2, row 0 from column 1
    assert r.tolist() == [0, 0, 1, 1] and c.tolist() == [2, 3, 1, 2]
    assert pos.tolist() == [2, 3, 5, 6]


def test_unpack_is_differentiable():
    p = pack_micro_batches(torch.tensor([3, 2]), 8)[0]
    y = torch.arange(5.0, requires_grad=True)
    p.unpack(y, 3).sum().backward()
    # scored positions: row 0 cols 1, 2 (packed 1, 2); row 1 col 1 (packed 4)
    assert y.grad.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=12),
    budget=st.integers(1, 30),
    multiple=st.sampled_from([1, 2, 4]),
)
def test_properties_against_the_reference(lengths, budget, multiple):
    S = max(lengths) + 2
    b = _Batch(lengths, S)
    packs = pack_micro_batches(b.lengths, budget, seq_multiple=multiple)
    want, slots = _reference_plan(lengths, budget, multiple)
    assert [p.rows.tolist() for p in packs] == want
    # every row once; the budget kept unless one row's slot alone is over it
    assert sorted(r for p in packs for r in p.rows.tolist()) == list(range(len(lengths)))
    for p in packs:
        assert p.width <= budget or len(p.rows) == 1
        assert p.width == sum(slots[r] for r in p.rows.tolist())
        assert p.pack(b.ids).tolist() == _reference_pack(b, p.rows.tolist(), slots, p.width)
        pos = p.position_ids()
        for i, r in enumerate(p.rows.tolist()):
            lo = int(p.cu_seqlens[i])
            assert pos[lo : lo + slots[r]].tolist() == list(range(slots[r]))
    # every real token once: token-aligned values unpacked restore each row (column 0 = 0)
    seen = torch.zeros(len(lengths), S)
    for p in packs:
        seen[p.rows] += p.unpack(p.pack(b.ids).float(), S)
    cols = torch.arange(S).unsqueeze(0)
    want_rows = b.ids.float() * (cols >= 1)
    assert torch.equal(seen, want_rows)
