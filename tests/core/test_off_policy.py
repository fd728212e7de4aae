"""Importance weights against the behaviour policy (core/off_policy.py): a hand-worked case
per mode and level, and a slow reference (Python loops over rows and tokens) on random data."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_d3s.core.off_policy import importance_weights


def _reference(old, behaviour, mask, cap, mode, level):
    """Row by row, token by token: (weight, keep) as nested lists."""
    weights, keeps = [], []
    for i in range(old.shape[0]):
        d = [float(old[i, t] - behaviour[i, t]) for t in range(old.shape[1])]
        resp = [bool(mask[i, t]) for t in range(old.shape[1])]
        n = sum(resp)
        seq = sum(x for x, r in zip(d, resp) if r) / max(n, 1)
        w_row, k_row = [], []
        for t in range(old.shape[1]):
            if not resp[t]:
                w_row.append(1.0)
                k_row.append(True)
                continue
            r = math.exp(seq if level == "sequence" else d[t])
            if mode == "truncate":
                w_row.append(min(r, cap))
                k_row.append(True)
            else:
                inside = 1 / cap <= r <= cap
                w_row.append(r if inside else 1.0)
                k_row.append(inside)
        weights.append(w_row)
        keeps.append(k_row)
    return weights, keeps


def test_hand_worked_token_and_sequence_levels():
    old = torch.tensor([[0.0, 0.0, math.log(3.0), math.log(0.25), 0.0]])
    behaviour = torch.zeros(1, 5)
    mask = torch.tensor([[False, True, True, True, False]])
    # token ratios on the response: 1, 3, 1/4; cap 2
    tr = importance_weights(old, behaviour, mask, 2.0, mode="truncate")
    assert tr.weight[0].tolist() == pytest.approx([1.0, 1.0, 2.0, 0.25, 1.0])
    assert bool(tr.keep.all())
    mk = importance_weights(old, behaviour, mask, 2.0, mode="mask")
    assert mk.keep[0].tolist() == [True, True, False, False, True]  # 3 > 2, 1/4 < 1/2
    assert mk.weight[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0])
    # sequence level: the geometric mean (3 x 1/4)^(1/3) = 0.75^(1/3) on every response token
    g = 0.75 ** (1 / 3)
    sq = importance_weights(old, behaviour, mask, 2.0, mode="mask", level="sequence")
    assert sq.weight[0].tolist() == pytest.approx([1.0, g, g, g, 1.0])
    assert bool(sq.keep.all())
    far = importance_weights(old * 8, behaviour, mask, 2.0, mode="mask", level="sequence")
    assert far.keep[0].tolist() == [True, False, False, False, True]  # 0.75^(8/3) < 1/2


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_vectorised_weights_equal_the_slow_reference(mode, level):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 7, generator=g) * 3
    behaviour = old + torch.randn(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) < 0.7
    mask[2] = False  # a row without response tokens
    old[~mask] = float("nan")  # off the response nothing is read
    iw = importance_weights(old, behaviour, mask, 1.5, mode=mode, level=level)
    want_w, want_k = _reference(old, behaviour, mask, 1.5, mode, level)
    assert iw.keep.tolist() == want_k
    torch.testing.assert_close(iw.weight, torch.tensor(want_w), rtol=1e-6, atol=1e-7)
    assert bool(torch.isfinite(iw.log_ratio).all())


def test_bad_settings_are_refused():
    x = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.bool)
    for kw, match in (({"mode": "clip"}, "mode"), ({"level": "row"}, "level")):
        with pytest.raises(ValueError, match=match):
            importance_weights(x, x, m, 2.0, **kw)
    with pytest.raises(ValueError, match="cap"):
        importance_weights(x, x, m, 0.5)
