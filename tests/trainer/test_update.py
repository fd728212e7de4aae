"""Compaction and the loss closure: hand-worked cases, and micro-batch invariance of the
globally normalised loss against a slow full-batch reference."""

from __future__ import annotations

import math
from typing import Dict

import pytest
import torch

from nemo_d3s.backends.base import TokenBatch
from nemo_d3s.core.losses import LossConfig, policy_loss, loss_denominator
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.trainer.stats import update_metrics
from nemo_d3s.trainer.update import (
    UpdateBatch,
    compact,
    make_loss_fn,
    minibatch_denominators,
    update_policy,
)

ONE = ParallelGroups()  # one process


def _upd(batch, old, adv, keep, minibatch, n_mb=1, aggregation="token_mean") -> UpdateBatch:
    """An UpdateBatch built by hand, with its denominators counted as compact() counts them;
    its rows are not cut (``whole_rows``)."""
    return UpdateBatch(
        batch,
        old,
        adv,
        keep,
        minibatch,
        denominators=minibatch_denominators(keep, minibatch, n_mb, aggregation),
        whole_rows=True,
    )


def _batch(B=4, S=6) -> TokenBatch:
    ids = torch.arange(B * S).view(B, S)
    attn = torch.ones(B, S, dtype=torch.bool)
    attn[3, 4:] = False  # right padding on row 3
    resp = torch.zeros(B, S, dtype=torch.bool)
    resp[:, 2:] = True
    resp &= attn
    return TokenBatch(ids, attn, resp)


def test_compact_drops_rows_without_tokens_and_cuts_after_last_kept():
    b = _batch()
    keep = torch.zeros(4, 6, dtype=torch.bool)
    keep[0, 2] = True  # row 0: last kept at 2 -> length 3
    keep[2, 3] = True
    keep[2, 4] = True  # row 2: last kept at 4 -> length 5
    # rows 1 and 3: nothing kept -> dropped
    old = torch.randn(4, 6)
    adv = torch.tensor([1.0, 2.0, -1.0, 3.0])
    mb = torch.tensor([0, 1, 0, 1])
    u = compact(b, keep, old, adv, mb)
    assert len(u) == 2
    assert u.batch.input_ids.shape == (2, 5)  # the longest remaining row
    assert torch.equal(u.batch.input_ids, b.input_ids[[0, 2], :5])
    assert u.batch.attention_mask.sum(1).tolist() == [
        3,
        5,
    ]  # each row cut after its last kept token
    assert u.batch.response_mask.sum(1).tolist() == [1, 3]
    assert torch.equal(u.advantages, adv[[0, 2]])
    assert torch.equal(u.old_logprobs, old[[0, 2], :5])
    assert u.token_keep.sum().item() == 3
    assert u.minibatch.tolist() == [0, 0]


def test_compact_of_nothing_is_empty():
    b = _batch()
    u = compact(
        b,
        torch.zeros(4, 6, dtype=torch.bool),
        torch.zeros(4, 6),
        torch.zeros(4),
        torch.zeros(4, dtype=torch.long),
    )
    assert len(u) == 0 and u.batch.input_ids.shape == (0, 0)


class _FakeBackend:
    """Calls loss_fn over micro-batches of a fixed 'policy' log-prob table (a parameter) and
    records the loss and gradient, applying the global denominator as a policy does (one
    process: the step normaliser's scale is 1 / denominator)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.param = table.clone().requires_grad_(True)
        self.losses = []

    def train_step(
        self,
        batch: TokenBatch,
        loss_fn,
        micro_batch_size: int,
        *,
        denominator: float,
        micro_batch_tokens: int = 0,
    ) -> Dict[str, float]:
        # The row of the table for a sequence is identified by its first input id.
        total = 0.0
        for lo in range(0, len(batch), micro_batch_size):
            rows = torch.arange(lo, min(len(batch), lo + micro_batch_size))
            idx = batch.input_ids[rows, 0] // 100
            lp = self.param[idx, : batch.input_ids.shape[1]]
            loss = loss_fn(lp, rows).loss / denominator
            loss.backward()
            total += float(loss.detach())
        self.losses.append(total)
        return {"grad_norm": float(self.param.grad.norm()), "lr": 0.1}


@pytest.mark.parametrize("loss_name", ["grpo", "gspo", "gspo_token"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_loss_is_micro_batch_invariant_and_matches_full_batch(loss_name, aggregation):
    torch.manual_seed(0)
    U, S = 5, 7
    ids = (torch.arange(U) * 100).unsqueeze(1).expand(U, S).clone()
    keep = torch.rand(U, S) < 0.5
    keep[:, 0] = False
    keep[:, 1] = True  # every row has a kept token
    upd = _upd(
        TokenBatch(ids, torch.ones(U, S, dtype=torch.bool), keep.clone()),
        -torch.rand(U, S),
        torch.randn(U),
        keep,
        torch.zeros(U, dtype=torch.long),
        aggregation=aggregation,
    )
    table = -torch.rand(U, S)
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, aggregation=aggregation)
    # Slow reference: one full-batch loss with the full-batch denominator.
    ref_param = table.clone().requires_grad_(True)
    out = policy_loss(
        loss_name,
        ref_param,
        upd.old_logprobs,
        upd.advantages,
        keep,
        cfg=cfg,
        denominator=loss_denominator(keep, aggregation),
    )
    out.loss.backward()
    for mbs in (1, 2, U):
        be = _FakeBackend(table)
        report = update_policy(
            be,
            upd,
            loss_name=loss_name,
            loss_cfg=cfg,
            num_mini_batches=1,
            micro_batch_size=mbs,
            groups=ONE,
        )
        assert report["optimizer_steps"] == 1
        assert be.losses[0] == pytest.approx(out.loss.item(), rel=1e-5, abs=1e-6)
        torch.testing.assert_close(be.param.grad, ref_param.grad, rtol=1e-5, atol=1e-6)
        assert report["update_tokens_local"] == int(
            keep.sum()
        )  # loss-carrying tokens (the papers' count)
        assert report["update_compute_tokens_local"] == U * S  # attended tokens (the compute)


def _all_kept(advantages: torch.Tensor, minibatch: torch.Tensor, n_mb: int, S: int = 3):
    """U = len(advantages) rows of S tokens, every token kept; row u's ids start at 100 u."""
    U = advantages.numel()
    ids = (torch.arange(U) * 100).unsqueeze(1).expand(U, S).clone()
    keep = torch.ones(U, S, dtype=torch.bool)
    batch = TokenBatch(ids, keep.clone(), keep.clone())
    return _upd(batch, torch.zeros(U, S), advantages, keep, minibatch, n_mb=n_mb)


def test_mini_batches_each_get_their_own_optimizer_step():
    U, S = 4, 3
    upd = _all_kept(torch.ones(U), torch.tensor([0, 1, 0, 2]), 4, S)
    be = _FakeBackend(torch.zeros(U, S))
    report = update_policy(
        be,
        upd,
        loss_name="grpo",
        loss_cfg=LossConfig(),
        num_mini_batches=4,
        micro_batch_size=8,
        groups=ONE,
    )
    assert report["optimizer_steps"] == 3  # mini-batch 3 is empty everywhere: no step
    assert len(be.losses) == 3


class _NonFiniteSecondStep(_FakeBackend):
    """Its second optimizer step meets a non-finite gradient norm and applies nothing, as the
    backends report it (``skipped`` = 1)."""

    def train_step(self, batch, loss_fn, micro_batch_size, **kw) -> Dict[str, float]:
        report = super().train_step(batch, loss_fn, micro_batch_size, **kw)
        if len(self.losses) == 2:
            report.update(grad_norm=float("inf"), skipped=1.0)
        return report


def test_a_step_with_a_non_finite_gradient_is_not_counted_as_trained():
    """Mini-batch 0 (rows 0, 2: 2 x 3 kept tokens) is applied, mini-batch 1 (rows 1, 3) is
    skipped by the backend: 1 optimizer step, 6 update tokens, grad_norm of the applied one."""
    U, S = 4, 3
    upd = _all_kept(torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([0, 1, 0, 1]), 2, S)
    be = _NonFiniteSecondStep(torch.zeros(U, S))
    kw = dict(loss_name="grpo", loss_cfg=LossConfig(), num_mini_batches=2, micro_batch_size=8)
    report = update_policy(be, upd, groups=ONE, **kw)
    assert len(be.losses) == 2  # both were tried
    assert report["optimizer_steps"] == 1 and report["skipped_nonfinite"] == 1
    assert report["update_tokens_local"] == 6 and report["update_compute_tokens_local"] == 6
    assert math.isfinite(report["grad_norm"])
    row = update_metrics(ONE, upd, report)
    assert row["update_tokens"] == 6 and row["skipped_nonfinite"] == 1
    assert row["optimizer_steps"] == 1


class _RouterLosses(_FakeBackend):
    """A MoE backend: each optimizer step reports its router losses' mean over the step (as
    ``megatron.moe.router_loss_metrics`` does), 0.25 and 0.5 on the two steps."""

    def train_step(self, batch, loss_fn, micro_batch_size, **kw) -> Dict[str, float]:
        report = super().train_step(batch, loss_fn, micro_batch_size, **kw)
        report.update(moe_load_balancing_loss=0.25 * len(self.losses), moe_z_loss=0.125)
        return report


def test_router_losses_are_the_mean_over_the_steps_optimizer_steps():
    """They were summed over the mini-batches (0.75 and 0.25 for 2), unlike the loss."""
    upd = _all_kept(torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([0, 1, 0, 1]), 2, 3)
    kw = dict(loss_name="grpo", loss_cfg=LossConfig(), num_mini_batches=2, micro_batch_size=8)
    report = update_policy(_RouterLosses(torch.zeros(4, 3)), upd, groups=ONE, **kw)
    row = update_metrics(ONE, upd, report)
    assert row["optimizer_steps"] == 2
    assert row["moe_load_balancing_loss"] == 0.375 and row["moe_z_loss"] == 0.125


def test_without_old_logprobs_the_current_policy_is_the_baseline():
    """old_logprobs=None (one on-policy step) == passing the current log-probs explicitly."""
    torch.manual_seed(1)
    U, S = 4, 5
    ids = (torch.arange(U) * 100).unsqueeze(1).expand(U, S).clone()
    keep = torch.rand(U, S) < 0.6
    keep[:, 1] = True
    table = -torch.rand(U, S)
    adv = torch.randn(U)
    grads = []
    for old in (None, table.clone()):
        upd = _upd(
            TokenBatch(ids, torch.ones(U, S, dtype=torch.bool), keep.clone()),
            old,
            adv,
            keep,
            torch.zeros(U, dtype=torch.long),
        )
        be = _FakeBackend(table)
        update_policy(
            be,
            upd,
            loss_name="grpo",
            loss_cfg=LossConfig(),
            num_mini_batches=1,
            micro_batch_size=2,
            groups=ONE,
        )
        grads.append(be.param.grad)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("loss_name", ["grpo", "gspo_token"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("normalize_by", ["kept", "eligible"])
def test_compaction_then_update_equals_the_uncompacted_full_batch_loss(
    loss_name, aggregation, normalize_by
):
    """Dropping rows without kept tokens and cutting tails must not change the loss or the
    gradient, for either normaliser: the 'eligible' one still counts the dropped rows and
    tails (reference: the core loss on the whole batch with norm_mask = response mask)."""
    torch.manual_seed(2)
    B, S = 6, 8
    ids = (torch.arange(B) * 100).unsqueeze(1).expand(B, S).clone()
    attn = torch.ones(B, S, dtype=torch.bool)
    attn[4, 6:] = False
    resp = torch.zeros(B, S, dtype=torch.bool)
    resp[:, 2:] = True
    resp &= attn
    keep = (torch.rand(B, S) < 0.3) & resp
    keep[:, 3] = True
    keep[1] = False  # a sample-selected row left with no kept token
    keep[2, 7] = False
    old, adv, table = -torch.rand(B, S), torch.randn(B), -torch.rand(B, S)
    mb = torch.zeros(B, dtype=torch.long)
    cfg = LossConfig(aggregation=aggregation)
    norm = resp if normalize_by == "eligible" else None
    ref_param = table.clone().requires_grad_(True)
    ref = policy_loss(
        loss_name,
        ref_param,
        old,
        adv,
        keep,
        cfg=cfg,
        denominator=loss_denominator(keep, aggregation, norm_mask=norm),
        norm_mask=norm,
        ratio_mask=resp if loss_name == "gspo_token" else None,  # its ratio: the response
    )
    ref.loss.backward()
    upd = compact(
        TokenBatch(ids, attn, resp),
        keep,
        old,
        adv,
        mb,
        aggregation=aggregation,
        normalize_by=normalize_by,
        loss_name=loss_name,
    )
    if loss_name == "gspo_token":  # whole rows: the ratio reads every response token
        assert upd.whole_rows and bool(
            (upd.batch.response_mask.sum(1) == resp[[0, *range(2, B)]].sum(1)).all()
        )
    assert len(upd) == B - 1
    be = _FakeBackend(table)
    update_policy(
        be,
        upd,
        loss_name=loss_name,
        loss_cfg=cfg,
        num_mini_batches=1,
        micro_batch_size=2,
        groups=ONE,
    )
    assert be.losses[0] == pytest.approx(ref.loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(be.param.grad, ref_param.grad, rtol=1e-5, atol=1e-7)
    if normalize_by == "eligible" and aggregation != "token_mean":
        assert upd.denominators.item() == B  # every sample-selected row counts, kept tokens or not


def test_a_loss_reading_the_whole_response_refuses_rows_cut_after_their_last_kept_token():
    batch = _batch()
    keep = batch.response_mask.clone()
    keep[:, 4:] = False
    upd = compact(batch, keep, None, torch.ones(4), torch.zeros(4, dtype=torch.long))
    assert not upd.whole_rows and upd.batch.input_ids.shape[1] == 4  # cut after column 3
    with pytest.raises(ValueError, match="keeps whole rows"):
        make_loss_fn("gspo_token", LossConfig(), upd)
    whole = compact(
        batch, keep, None, torch.ones(4), torch.zeros(4, dtype=torch.long), loss_name="gspo_token"
    )
    assert whole.whole_rows and whole.batch.input_ids.shape[1] == 6
    make_loss_fn("gspo_token", LossConfig(), whole)


def test_eligible_normaliser_gives_smaller_steps_than_kept():
    # Hand-worked: 1 row, 4 response tokens, 1 kept, A=1, ratio 1: grpo token loss = -1 per
    # kept token. kept: -1/1; eligible: -1/4.
    ids = torch.zeros(1, 5, dtype=torch.long)
    attn = torch.ones(1, 5, dtype=torch.bool)
    resp = attn.clone()
    resp[0, 0] = False
    keep = torch.zeros(1, 5, dtype=torch.bool)
    keep[0, 2] = True
    for normalize_by, expected in (("kept", -1.0), ("eligible", -0.25)):
        upd = compact(
            TokenBatch(ids, attn, resp),
            keep,
            torch.zeros(1, 5),
            torch.ones(1),
            torch.zeros(1, dtype=torch.long),
            normalize_by=normalize_by,
        )
        be = _FakeBackend(torch.zeros(1, 5))
        update_policy(
            be,
            upd,
            loss_name="grpo",
            loss_cfg=LossConfig(),
            num_mini_batches=1,
            micro_batch_size=1,
            groups=ONE,
        )
        assert be.losses[0] == pytest.approx(expected)
    with pytest.raises(ValueError, match="normalize_by"):
        compact(
            TokenBatch(ids, attn, resp),
            keep,
            None,
            torch.ones(1),
            torch.zeros(1, dtype=torch.long),
            normalize_by="all",
        )
