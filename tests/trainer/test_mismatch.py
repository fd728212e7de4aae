"""Rollout/train mismatch: the metrics and the truncated importance-sampling weights,
hand-worked, and how the weights enter the loss (per token; per row for GSPO)."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_d3s.backends.base import TokenBatch
from nemo_d3s.core.losses import LossConfig, policy_loss
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.core.off_policy import importance_weights
from nemo_d3s.trainer.stats import importance_metrics, mismatch_metrics
from nemo_d3s.trainer.update import compact, make_loss_fn


def test_mismatch_metrics_hand_worked():
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    samp = torch.tensor([[0.0, -1.5, -1.0, 5.0]])
    mask = torch.tensor([[False, True, True, False]])
    # d = old - samp on the mask: [0.5, -1.0]
    m = mismatch_metrics(ParallelGroups(), old, samp, mask)
    k3 = [math.exp(0.5) - 0.5 - 1, math.exp(-1.0) + 1.0 - 1]
    assert m["rollout_logprob_mismatch_kl"] == pytest.approx(sum(k3) / 2)
    assert m["rollout_logprob_mismatch_abs"] == pytest.approx(0.75)
    assert m["rollout_logprob_mismatch_max_ratio"] == pytest.approx(math.exp(0.5))


def test_truncated_weights_hand_worked():
    old = torch.tensor([[0.0, 0.0, -3.0, 0.0]])
    samp = torch.tensor([[9.0, -2.0, -1.0, 0.0]])
    mask = torch.tensor([[False, True, True, True]])
    w = importance_weights(old, samp, mask, 2.0).weight
    assert w.tolist()[0] == pytest.approx(
        [1.0, 2.0, math.exp(-2.0), 1.0]
    )  # e^2 capped at 2; off-mask 1


def test_importance_metrics_hand_worked():
    """Ratios e^-1, 1, e^1, e^2 on the response; cap 2: the selected tokens with r > 2 are
    truncated (e^1 and e^2: one of the three selected), or masked (outside [1/2, 2])."""
    old = torch.tensor([[0.0, -1.0, 0.0, 1.0, 2.0]])
    samp = torch.zeros(1, 5)
    resp = torch.tensor([[False, True, True, True, True]])
    sel = torch.tensor([[False, True, True, False, True]])
    for mode, name in (("truncate", "is_truncated_share"), ("mask", "is_masked_share")):
        iw = importance_weights(old, samp, resp, 2.0, mode=mode)
        m = importance_metrics(ParallelGroups(), iw, resp, sel, 2.0, mode)
        assert m["is_ratio_min"] == pytest.approx(math.exp(-1.0))
        assert m["is_ratio_p50"] == pytest.approx(1.0)  # lower median of 4: the 2nd
        assert m["is_ratio_max"] == pytest.approx(math.exp(2.0))
        want = 1 / 3 if mode == "truncate" else 2 / 3  # mask: e^-1 < 1/2 and e^2 > 2
        assert m[name] == pytest.approx(want)


@pytest.mark.parametrize("loss_name", ["grpo", "gspo_token", "gspo"])
def test_weights_scale_the_advantage_in_the_loss(loss_name):
    torch.manual_seed(0)
    B, S = 3, 5
    ids = torch.arange(B * S).view(B, S)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, 0] = False
    keep = mask.clone()
    old, adv = -torch.rand(B, S), torch.tensor([1.0, -0.5, 2.0])
    w = 0.5 + torch.rand(B, S)
    upd = compact(
        TokenBatch(ids, torch.ones(B, S, dtype=torch.bool), mask),
        keep,
        old,
        adv,
        torch.zeros(B, dtype=torch.long),
        is_weight=w,
        loss_name=loss_name,
    )
    lp = (old + 0.1 * torch.randn(B, S)).requires_grad_(True)
    got = make_loss_fn(loss_name, LossConfig(), upd)(lp, torch.arange(B)).loss
    if loss_name == "gspo":  # one weight per sequence: the mean over its kept tokens
        scaled = adv * (w * keep).sum(1) / keep.sum(1)
    else:
        scaled = adv.unsqueeze(1) * w
    ratio = mask if loss_name == "gspo_token" else None  # its ratio: the response
    want = policy_loss(
        loss_name, lp, old, scaled, keep, cfg=LossConfig(), denominator=1.0, ratio_mask=ratio
    ).loss
    assert torch.allclose(got, want)
    plain = make_loss_fn(
        loss_name,
        LossConfig(),
        compact(
            TokenBatch(ids, torch.ones(B, S, dtype=torch.bool), mask),
            keep,
            old,
            adv,
            torch.zeros(B, dtype=torch.long),
            loss_name=loss_name,
        ),
    )
    assert not torch.allclose(plain(lp, torch.arange(B)).loss, got)  # the weights did something
