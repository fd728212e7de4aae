"""Policy losses: hand-worked numbers for every branch (clip low/inside/high for A > 0 and
A < 0, dual clip, GSPO sequence ratio, GSPO-token, k3 KL, aggregations), micro-batch split
invariance of loss, gradient and metrics, masking hygiene, validation."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_d3s.core.losses import (
    AGGREGATIONS,
    LossConfig,
    finalize_metrics,
    loss_denominator,
    policy_loss,
)

LOSSES = ("grpo", "gspo", "gspo_token")
F64 = torch.float64


def _lp(log_ratios, requires_grad=True):
    """logprobs with old_logprobs = 0, so that logprobs IS log(ratio)."""
    return torch.tensor(log_ratios, dtype=F64, requires_grad=requires_grad)


def _run(name, logprobs, old, adv, mask, cfg, denominator, **kw):
    out = policy_loss(name, logprobs, old, adv, mask, cfg=cfg, denominator=denominator, **kw)
    (grad,) = torch.autograd.grad(out.loss, logprobs, allow_unused=False)
    return out, grad


# ---------------------------------------------------------------------------- GRPO by hand


def test_grpo_every_clip_branch_by_hand():
    # eps_low 0.2, eps_high 0.28 (asymmetric): clip range [0.8, 1.28]
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    r = [0.5, 1.1, 1.5, 0.5, 1.1, 1.5]
    a = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
    lp = _lp([[math.log(x) for x in r]])
    old = torch.zeros(1, 6, dtype=F64)
    mask = torch.ones(1, 6, dtype=torch.bool)
    out, grad = _run("grpo", lp, old, torch.tensor([a], dtype=F64), mask, cfg, 6.0)
    # per token max(-rA, -clip(r)A):
    #  r=0.5 A=+1: max(-0.5, -0.8)  = -0.5   (below clip, A>0: not clipped, grad -rA = -0.5)
    #  r=1.1 A=+1: max(-1.1, -1.1)  = -1.1   (inside, grad -1.1)
    #  r=1.5 A=+1: max(-1.5, -1.28) = -1.28  (above clip: clipped, grad 0)
    #  r=0.5 A=-1: max( 0.5,  0.8)  =  0.8   (below clip: clipped, grad 0)
    #  r=1.1 A=-1: max( 1.1,  1.1)  =  1.1   (inside, grad -rA = 1.1)
    #  r=1.5 A=-1: max( 1.5,  1.28) =  1.5   (above, A<0: not clipped, grad 1.5)
    # token_mean over 6: (-0.5 - 1.1 - 1.28 + 0.8 + 1.1 + 1.5) / 6 = 0.52 / 6
    assert out.loss.item() == pytest.approx(0.52 / 6, abs=1e-12)
    # d/dlogp of -r A = -r A (since dr/dlogp = r)
    expected = torch.tensor([[-0.5, -1.1, 0.0, 0.0, 1.1, 1.5]], dtype=F64) / 6
    assert torch.allclose(grad, expected, atol=1e-12)
    m = out.metrics
    assert (m["clip_frac_low_sum"], m["clip_frac_high_sum"], m["dual_clip_frac_sum"]) == (
        1.0,
        1.0,
        0.0,
    )
    assert (m["token_count"], m["seq_count"]) == (6.0, 1.0)
    assert m["ratio_sum"] == pytest.approx(0.5 + 1.1 + 1.5 + 0.5 + 1.1 + 1.5, abs=1e-12)
    assert m["pg_loss"] == pytest.approx(0.52 / 6, abs=1e-12) and m["kl_loss"] == 0.0
    # approx_kl: k3(d) = exp(d) - d - 1 with d = log r  ->  r - log r - 1
    k3 = sum(x - math.log(x) - 1 for x in r)
    assert m["approx_kl_sum"] == pytest.approx(k3, abs=1e-12)
    fin = finalize_metrics(m)
    assert fin["clip_frac_low"] == pytest.approx(1 / 6) and fin["approx_kl"] == pytest.approx(
        k3 / 6
    )


def test_grpo_dual_clip_by_hand():
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)
    r = [4.0, 1.5, 4.0]
    a = [-1.0, -1.0, 2.0]
    lp = _lp([[math.log(x) for x in r]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    out, grad = _run(
        "grpo", lp, torch.zeros(1, 3, dtype=F64), torch.tensor([a], dtype=F64), mask, cfg, 3.0
    )
    #  r=4,   A=-1: max(4, 1.2) = 4 -> dual clip min(4, -cA = 3) = 3, grad 0
    #  r=1.5, A=-1: max(1.5, 1.2) = 1.5 -> min(1.5, 3) = 1.5 (dual clip not binding), grad 1.5
    #  r=4,   A=+2: max(-8, -2.4) = -2.4 (clip high; dual clip never applies to A > 0), grad 0
    assert out.loss.item() == pytest.approx((3.0 + 1.5 - 2.4) / 3, abs=1e-12)
    assert torch.allclose(grad, torch.tensor([[0.0, 1.5, 0.0]], dtype=F64) / 3, atol=1e-12)
    m = out.metrics
    assert (m["dual_clip_frac_sum"], m["clip_frac_high_sum"], m["clip_frac_low_sum"]) == (
        1.0,
        1.0,
        0.0,
    )
    # without dual clip the first token would cost 4
    out2, _ = _run(
        "grpo",
        lp,
        torch.zeros(1, 3, dtype=F64),
        torch.tensor([a], dtype=F64),
        mask,
        LossConfig(),
        3.0,
    )
    assert out2.loss.item() == pytest.approx((4.0 + 1.5 - 2.4) / 3, abs=1e-12)


def test_grpo_broadcast_advantages_equal_per_token():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 5, generator=g, dtype=F64) * 0.3).requires_grad_(True)
    old = torch.zeros(3, 5, dtype=F64)
    adv = torch.randn(3, generator=g, dtype=F64)
    mask = torch.rand(3, 5, generator=g) < 0.7
    a = policy_loss("grpo", lp, old, adv, mask, denominator=7.0)
    b = policy_loss("grpo", lp, old, adv.unsqueeze(1).expand(3, 5), mask, denominator=7.0)
    assert a.loss.item() == b.loss.item() and a.metrics == b.metrics


# ---------------------------------------------------------------------------- GSPO by hand


def _gspo_case():
    # row 0: masked log-ratios [0.1, -0.2, 0.4] -> mean 0.1 -> s = e^0.1 = 1.10517 (inside)
    #        plus an UNMASKED token with log-ratio 5 and NaN old log-prob: must not count
    # row 1: [0.3, 0.3] -> s = e^0.3 = 1.34986 > 1.2, A = +1: clipped at 1.2
    # row 2: [-0.5] -> s = e^-0.5 = 0.60653 < 0.8, A = -1: clipped at 0.8
    nan = float("nan")
    lp = _lp([[0.1, -0.2, 0.4, 5.0], [0.3, 0.3, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0]])
    old = torch.tensor(
        [[0.0, 0.0, 0.0, nan], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=F64)
    return lp, old, adv, mask


def test_gspo_sequence_ratio_by_hand():
    lp, old, adv, mask = _gspo_case()
    cfg = LossConfig(aggregation="seq_mean_token_mean")
    out, grad = _run("gspo", lp, old, adv, mask, cfg, 3.0)
    s0 = math.exp((0.1 - 0.2 + 0.4) / 3)  # = e^0.1
    # L_0 = max(-s0, -clip(s0)) = -s0; L_1 = max(-1.34986, -1.2) = -1.2;
    # L_2 = max(0.60653, 0.8) = 0.8
    assert out.loss.item() == pytest.approx((-s0 - 1.2 + 0.8) / 3, abs=1e-12)
    # only row 0 has a gradient: dL_0/dlogp_t = -A s0 / n_0 = -s0/3 per masked token, / 3 sequences
    expected = torch.zeros(3, 4, dtype=F64)
    expected[0, :3] = -s0 / 3 / 3
    assert torch.allclose(grad, expected, atol=1e-12)
    m = out.metrics
    # token-weighted: row 1's 2 tokens clipped high, row 2's 1 token clipped low
    assert (m["clip_frac_high_sum"], m["clip_frac_low_sum"], m["token_count"]) == (2.0, 1.0, 6.0)
    assert m["ratio_sum"] == pytest.approx(3 * s0 + 2 * math.exp(0.3) + math.exp(-0.5), abs=1e-12)

    # token_mean: each sequence loss weighted by its masked-token count, / 6 tokens
    out, grad = _run("gspo", lp, old, adv, mask, LossConfig(), 6.0)
    assert out.loss.item() == pytest.approx((3 * -s0 + 2 * -1.2 + 1 * 0.8) / 6, abs=1e-12)
    expected[0, :3] = 3 * (-s0 / 3) / 6
    assert torch.allclose(grad, expected, atol=1e-12)

    # seq_mean_token_sum: weighted by token count too, / 3 sequences
    out, _ = _run("gspo", lp, old, adv, mask, LossConfig(aggregation="seq_mean_token_sum"), 3.0)
    assert out.loss.item() == pytest.approx((3 * -s0 + 2 * -1.2 + 1 * 0.8) / 3, abs=1e-12)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gspo_token_value_equals_gspo_and_gradient_only_on_masked(aggregation):
    lp, old, adv, mask = _gspo_case()
    cfg = LossConfig(aggregation=aggregation)
    d = loss_denominator(mask, aggregation)
    seq, g_seq = _run("gspo", lp, old, adv, mask, cfg, d)
    tok, g_tok = _run("gspo_token", lp, old, adv, mask, cfg, d)
    assert tok.loss.item() == pytest.approx(seq.loss.item(), abs=1e-12)
    assert (g_tok[~mask] == 0).all()
    # one advantage per sequence: GSPO-token's gradient is GSPO's as well
    assert torch.allclose(g_tok, g_seq, atol=1e-12)
    assert tok.metrics == pytest.approx(seq.metrics, abs=1e-12)


def test_gspo_token_per_token_advantages_by_hand():
    # one row, masked log-ratios [0.1, -0.2, 0.4] (s = e^0.1), unmasked last token
    lp = _lp([[0.1, -0.2, 0.4, 2.0]])
    old = torch.zeros(1, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, -1.0, 2.0, 9.0]], dtype=F64)
    out, grad = _run("gspo_token", lp, old, adv, mask, LossConfig(), 3.0)
    s = math.exp(0.1)  # inside [0.8, 1.2] for every token
    # per-token value l = -s A_t: (-s + s - 2 s) / 3; gradient of token t: -A_t s / 3
    assert out.loss.item() == pytest.approx(-2 * s / 3, abs=1e-12)
    assert torch.allclose(grad, torch.tensor([[-s, s, -2 * s, 0.0]], dtype=F64) / 3, atol=1e-12)
    # GSPO proper refuses per-token advantages that differ within a sequence
    with pytest.raises(ValueError, match="constant on each row"):
        policy_loss("gspo", lp, old, adv, mask, denominator=3.0)


def test_gspo_token_takes_its_ratio_over_the_whole_response_and_its_gradient_from_kept_tokens():
    """papers.md's two readings of GSPO under token masks: ``gspo`` takes s_i over the kept
    tokens; ``gspo_token`` over the whole response (``ratio_mask``), the gradient still through
    the kept tokens only. One row: log-ratios [0.3, 0.1, -0.1, -0.3], tokens 0 and 1 kept, A = 1.
    gspo: s = e^{(0.3 + 0.1) / 2} = e^0.2 > 1.2, clipped: value -1.2 a token, no gradient.
    gspo_token: s = e^{0 / 4} = 1, inside the clip: value -1 a token, gradient -s A / 2 = -1/2
    on each kept token, 0 on the others. Before, both read the kept tokens and were equal."""
    lp = _lp([[0.3, 0.1, -0.1, -0.3]])
    old = torch.zeros(1, 4, dtype=F64)
    keep = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    response = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=F64)
    seq, g_seq = _run("gspo", lp, old, adv, keep, LossConfig(), 2.0)
    assert seq.loss.item() == pytest.approx(-1.2, abs=1e-12) and (g_seq == 0).all()
    tok, g_tok = _run("gspo_token", lp, old, adv, keep, LossConfig(), 2.0, ratio_mask=response)
    assert tok.loss.item() == pytest.approx(-1.0, abs=1e-12)
    assert torch.allclose(g_tok, torch.tensor([[-0.5, -0.5, 0.0, 0.0]], dtype=F64), atol=1e-12)
    # NaN log-probs off the response change nothing; a ratio mask short of the loss mask is refused
    lp_nan = _lp([[0.3, 0.1, -0.1, float("nan")]])
    out, _ = _run(
        "gspo_token",
        lp_nan,
        old,
        adv,
        keep,
        LossConfig(),
        2.0,
        ratio_mask=response & torch.tensor([[1, 1, 1, 0]], dtype=torch.bool),
    )
    assert math.isfinite(out.loss.item())
    with pytest.raises(ValueError, match="ratio_mask must cover loss_mask"):
        policy_loss("gspo_token", lp, old, adv, keep, denominator=2.0, ratio_mask=~keep)


def test_gspo_token_clipped_sequence_has_no_gradient():
    lp = _lp([[0.3, 0.3]])  # s = e^0.3 > 1.2
    out, grad = _run(
        "gspo_token",
        lp,
        torch.zeros(1, 2, dtype=F64),
        torch.tensor([1.0], dtype=F64),
        torch.ones(1, 2, dtype=torch.bool),
        LossConfig(),
        2.0,
    )
    assert out.loss.item() == pytest.approx(-1.2, abs=1e-12)  # 2 x (-1.2) / 2
    assert (grad == 0).all()


# ---------------------------------------------------------------------------- KL and norm


@pytest.mark.parametrize("name", LOSSES)
def test_k3_kl_by_hand(name):
    # A = 0: the policy term vanishes and only the KL is left
    lp = _lp([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-0.5, -2.5, 7.0]], dtype=F64)  # ref - logp = [0.5, -0.5, (unmasked)]
    mask = torch.tensor([[True, True, False]])
    cfg = LossConfig(kl_coef=0.1)
    out, grad = _run(
        name, lp, lp.detach(), torch.zeros(1, dtype=F64), mask, cfg, 2.0, ref_logprobs=ref
    )
    k3_a = math.exp(0.5) - 0.5 - 1  # 0.148721
    k3_b = math.exp(-0.5) + 0.5 - 1  # 0.106531
    assert out.loss.item() == pytest.approx(0.1 * (k3_a + k3_b) / 2, abs=1e-12)
    assert out.metrics["ref_kl_sum"] == pytest.approx(k3_a + k3_b, abs=1e-12)
    assert out.metrics["kl_loss"] == pytest.approx(out.loss.item(), abs=1e-12)
    # d/dlogp [exp(x) - x - 1], x = ref - logp:  -(exp(x) - 1)
    expected = (
        torch.tensor([[-(math.exp(0.5) - 1), -(math.exp(-0.5) - 1), 0.0]], dtype=F64) * 0.1 / 2
    )
    assert torch.allclose(grad, expected, atol=1e-12)


def test_ref_logprobs_without_kl_coef_is_only_monitored():
    lp = _lp([[-1.0, -2.0]])
    ref = torch.tensor([[-0.5, -2.5]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(
        "grpo", lp, lp.detach(), torch.zeros(1, dtype=F64), mask, denominator=2.0, ref_logprobs=ref
    )
    assert out.loss.item() == 0.0 and out.metrics["ref_kl_sum"] > 0


def test_seq_mean_token_mean_norm_mask_by_hand():
    # r = 1, A = 1 -> per-token loss -1 on the 2 selected of 4 response tokens; row 1 has 1 of 1
    lp = _lp([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = torch.zeros(2, 4, dtype=F64)
    adv = torch.ones(2, dtype=F64)
    loss_mask = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    norm_mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    cfg = LossConfig(aggregation="seq_mean_token_mean")
    # selected-token normalisation: row means (-2/2, -1/1) -> (-1 - 1) / 2
    out = policy_loss("grpo", lp, old, adv, loss_mask, cfg=cfg, denominator=2.0)
    assert out.loss.item() == pytest.approx(-1.0, abs=1e-12)
    # all-token normalisation: row means (-2/4, -1/1) -> (-0.5 - 1) / 2
    out = policy_loss(
        "grpo", lp, old, adv, loss_mask, cfg=cfg, denominator=2.0, norm_mask=norm_mask
    )
    assert out.loss.item() == pytest.approx(-0.75, abs=1e-12)
    # GSPO: sequence loss -1 on each selected token, same weights
    out = policy_loss(
        "gspo", lp, old, adv, loss_mask, cfg=cfg, denominator=2.0, norm_mask=norm_mask
    )
    assert out.loss.item() == pytest.approx(-0.75, abs=1e-12)
    # token_mean and seq_mean_token_sum ignore norm_mask
    for agg, expected in (("token_mean", -3 / 3), ("seq_mean_token_sum", -3 / 2)):
        c = LossConfig(aggregation=agg)
        d = loss_denominator(loss_mask, agg)
        assert policy_loss(
            "grpo", lp, old, adv, loss_mask, cfg=c, denominator=d, norm_mask=norm_mask
        ).loss.item() == (pytest.approx(expected, abs=1e-12))


def test_loss_denominator():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 0]], dtype=torch.bool)
    norm = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    assert loss_denominator(mask, "token_mean") == 3.0
    assert loss_denominator(mask, "seq_mean_token_mean") == 2.0
    assert loss_denominator(mask, "seq_mean_token_sum") == 2.0
    assert loss_denominator(mask, "token_mean", norm_mask=norm) == 5.0
    assert loss_denominator(mask, "seq_mean_token_mean", norm_mask=norm) == 3.0
    with pytest.raises(ValueError, match="aggregation"):
        loss_denominator(mask, "sum")


# ---------------------------------------------------------------------------- split invariance


def _random_batch(seed, B=7, S=9, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=g, dtype=F64) * 3
    lp = old + torch.randn(B, S, generator=g, dtype=F64) * 0.4  # wide enough to clip
    ref = old + torch.randn(B, S, generator=g, dtype=F64) * 0.3
    adv = (
        torch.randn(B, S, generator=g, dtype=F64)
        if per_token_adv
        else torch.randn(B, generator=g, dtype=F64)
    )
    norm_mask = torch.rand(B, S, generator=g) < 0.8
    loss_mask = norm_mask & (torch.rand(B, S, generator=g) < 0.6)
    loss_mask[0] = False  # an empty row
    norm_mask[0] = False
    loss_mask[1, 2] = norm_mask[1, 2] = True
    # garbage where nothing is counted must not matter
    old = old.masked_fill(~loss_mask, float("nan"))
    return lp, old, adv, loss_mask, norm_mask, ref


# gspo needs one advantage per sequence, so it runs with [B] advantages only
@pytest.mark.parametrize(
    "name, per_token_adv",
    [("grpo", False), ("grpo", True), ("gspo", False), ("gspo_token", False), ("gspo_token", True)],
)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_split_gives_full_batch_loss_and_gradient(name, per_token_adv, aggregation):
    cfg = LossConfig(
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=2.0, kl_coef=0.05, aggregation=aggregation
    )
    for seed in range(3):
        lp0, old, adv, loss_mask, norm_mask, ref = _random_batch(seed, per_token_adv=per_token_adv)
        denom = loss_denominator(loss_mask, aggregation)  # the "global" count

        full_lp = lp0.clone().requires_grad_(True)
        full = policy_loss(
            name,
            full_lp,
            old,
            adv,
            loss_mask,
            cfg=cfg,
            denominator=denom,
            ref_logprobs=ref,
            norm_mask=norm_mask,
        )
        full.loss.backward()

        split_lp = lp0.clone().requires_grad_(True)
        total = 0.0
        summed: dict = {}
        for lo, hi in ((0, 2), (2, 3), (3, 7)):
            out = policy_loss(
                name,
                split_lp[lo:hi],
                old[lo:hi],
                adv[lo:hi],
                loss_mask[lo:hi],
                cfg=cfg,
                denominator=denom,
                ref_logprobs=ref[lo:hi],
                norm_mask=norm_mask[lo:hi],
            )
            total = total + out.loss
            for k, v in out.metrics.items():
                summed[k] = summed.get(k, 0.0) + v
        total.backward()
        assert total.item() == pytest.approx(full.loss.item(), abs=1e-12)
        assert torch.allclose(split_lp.grad, full_lp.grad, atol=1e-12)
        assert summed == pytest.approx(full.metrics, abs=1e-12)
        assert torch.isfinite(full_lp.grad).all()
        assert (full_lp.grad[~loss_mask] == 0).all()
        # the local denominators add up to the global one
        parts = sum(
            loss_denominator(loss_mask[lo:hi], aggregation) for lo, hi in ((0, 2), (2, 3), (3, 7))
        )
        assert parts == denom


@pytest.mark.parametrize("name", LOSSES)
def test_empty_mask_gives_zero_loss_and_zero_gradient(name):
    lp = torch.full((1, 2), float("nan"), dtype=F64, requires_grad=True)
    mask = torch.zeros(1, 2, dtype=torch.bool)
    out = policy_loss(
        name, lp, torch.zeros(1, 2, dtype=F64), torch.zeros(1, dtype=F64), mask, denominator=5.0
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and (lp.grad == 0).all()
    assert out.metrics["token_count"] == 0.0
    assert finalize_metrics(out.metrics)["clip_frac_low"] == 0.0


def test_bf16_logprobs_compute_in_fp32():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss("grpo", lp, lp.detach().float(), torch.ones(1), mask, denominator=2.0)
    assert out.loss.dtype == torch.float32 and out.loss.item() == pytest.approx(-1.0)
    out.loss.backward()
    assert lp.grad.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- validation


def test_finalize_metrics():
    m = {
        "token_count": 4.0,
        "clip_frac_high_sum": 1.0,
        "approx_kl_sum": 0.2,
        "pg_loss": -0.3,
        "loss": 1.0,
    }
    assert finalize_metrics(m) == pytest.approx(
        {
            "token_count": 4.0,
            "clip_frac_high": 0.25,
            "approx_kl": 0.05,
            "pg_loss": -0.3,
            "loss": 1.0,
        }
    )
    with pytest.raises(ValueError, match="token_count"):
        finalize_metrics({"ratio_sum": 1.0})


def test_validation_messages():
    lp = _lp([[-1.0, -2.0]])
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.ones(1, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    kw = dict(denominator=2.0)
    with pytest.raises(ValueError, match="loss_mask must be a bool"):
        policy_loss("grpo", lp, old, adv, mask.float(), **kw)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(1, 3\)"):
        policy_loss("grpo", lp, torch.zeros(1, 3, dtype=F64), adv, mask, **kw)
    with pytest.raises(ValueError, match=r"advantages has shape \(2,\)"):
        policy_loss("grpo", lp, old, torch.ones(2, dtype=F64), mask, **kw)
    with pytest.raises(ValueError, match="logprobs .*finite"):
        policy_loss("grpo", _lp([[float("-inf"), 0.0]]), old, adv, mask, **kw)
    with pytest.raises(ValueError, match="old_logprobs .*finite"):
        policy_loss("grpo", lp, torch.tensor([[0.0, float("nan")]], dtype=F64), adv, mask, **kw)
    with pytest.raises(ValueError, match="advantages .*finite"):
        policy_loss("grpo", lp, old, torch.tensor([float("inf")], dtype=F64), mask, **kw)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="denominator"):
            policy_loss("grpo", lp, old, adv, mask, denominator=bad)
    with pytest.raises(ValueError, match="clip_eps_low"):
        LossConfig(clip_eps_low=-0.1)
    with pytest.raises(ValueError, match="clip_eps_high"):
        LossConfig(clip_eps_high=float("nan"))
    for c in (1.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match="dual_clip_c"):
            LossConfig(dual_clip_c=c)
    with pytest.raises(ValueError, match="kl_coef"):
        LossConfig(kl_coef=-1.0)
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="ref_logprobs is required"):
        policy_loss("grpo", lp, old, adv, mask, cfg=LossConfig(kl_coef=0.1), **kw)
    with pytest.raises(ValueError, match="norm_mask must cover loss_mask"):
        policy_loss(
            "grpo",
            lp,
            old,
            adv,
            mask,
            cfg=LossConfig(aggregation="seq_mean_token_mean"),
            norm_mask=torch.tensor([[True, False]]),
            **kw,
        )
    with pytest.raises(ValueError, match="different devices"):
        policy_loss("grpo", lp, old.to("meta"), adv, mask, **kw)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*gspo_token"):
        policy_loss("ppo", lp, old, adv, mask, **kw)
