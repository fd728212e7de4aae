"""The local spec's packed attention mask: block-diagonal causal over cu_seqlens, against
the obvious double loop and a hand-worked case."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_d3s.backends.megatron.local_attention import segment_causal_mask


def test_hand_worked_mask():
    # slots [0, 2) and [2, 5): each position sees its own slot up to itself
    assert segment_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32)).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_mask_against_the_double_loop(slots):
    cu = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()])
    slot_of = [i for i, n in enumerate(slots) for _ in range(n)]
    want = [
        [slot_of[i] == slot_of[j] and j <= i for j in range(len(slot_of))]
        for i in range(len(slot_of))
    ]
    assert segment_causal_mask(cu).tolist() == want
