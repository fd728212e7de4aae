"""Token layout helpers of the HF backend (pure functions, hand-worked cases)."""

import pytest
import torch

from nemo_d3s.backends.hf.rollout import cut_at_eos, left_pad, real_length, right_padded_batch


def test_left_pad_hand_case():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize(
    "generated, expected, done",
    [
        ([4, 5, 2, 2, 2], [4, 5, 2], True),  # pad == EOS: filler after the first EOS is dropped
        ([4, 2, 9, 9], [4, 2], True),  # pad != EOS
        ([2], [2], True),  # immediate EOS is a one-token response
        ([4, 5, 6], [4, 5, 6], False),  # ran out of max_new_tokens
        ([], [], False),
    ],
)
def test_cut_at_eos(generated, expected, done):
    assert cut_at_eos(generated, [2]) == (expected, done)


def test_cut_at_eos_several_eos_ids():
    assert cut_at_eos([4, 7, 3, 2], [2, 3]) == ([4, 7, 3], True)


def test_right_padded_batch_hand_case():
    batch = right_padded_batch([[1, 2], [3]], [[4, 5, 6], [7]], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch.attention_mask.dtype == torch.bool and batch.response_mask.dtype == torch.bool


def test_right_padded_batch_empty_response_and_mismatch():
    batch = right_padded_batch([[1, 2]], [[]], pad_id=0)
    assert batch.response_mask.sum() == 0 and batch.attention_mask.sum() == 2
    with pytest.raises(ValueError, match="prompt_ids"):
        right_padded_batch([[1]], [[2], [3]], pad_id=0)


def test_real_length():
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    assert real_length(m) == 3
    assert real_length(torch.zeros((2, 4), dtype=torch.bool)) == 0
    assert real_length(torch.zeros((0, 4), dtype=torch.bool)) == 0
