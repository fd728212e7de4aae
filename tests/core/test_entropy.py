"""Entropy and log-probs from full logits: hand cases, a naive log_softmax reference (fp32,
bf16, fp64), chunking invariance, gradients, strided inputs, alignment, validation."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs


def _naive(logits: torch.Tensor, target_ids: torch.Tensor):
    """Reference: full log_softmax in fp64 (no chunking, no tricks)."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy, logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)


def _case(B=3, S=5, V=37, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, S, V, generator=g) * scale).to(dtype)
    target_ids = torch.randint(0, V, (B, S), generator=g)
    return logits, target_ids


# ---------------------------------------------------------------------------- hand cases


def test_uniform_distribution_entropy_is_log_v():
    V = 50
    logits = torch.full((2, 3, V), 7.25)  # equal logits, any offset: uniform distribution
    ids = torch.randint(0, V, (2, 3))
    entropy, logprobs = entropy_and_logprobs(logits, ids)
    assert torch.allclose(entropy, torch.full((2, 3), math.log(V)), atol=1e-6)
    assert torch.allclose(logprobs, torch.full((2, 3), -math.log(V)), atol=1e-6)


def test_two_token_hand_case():
    # logits [0, log 3] -> p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64)
    entropy, logprobs = entropy_and_logprobs(logits, torch.tensor([[1]]))
    expected_h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # 0.5623351446...
    assert entropy.item() == pytest.approx(expected_h, abs=1e-12)
    assert logprobs.item() == pytest.approx(math.log(0.75), abs=1e-12)


def test_two_token_hand_case_at_a_temperature():
    # logits [0, ln 3] at T = 0.5 -> z = [0, 2 ln 3] -> p = [1/10, 9/10]; the gradient of
    # log p(1) in the logits is (onehot - p) / T = [-0.2, 0.2]
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64, requires_grad=True)
    entropy, logprobs = entropy_and_logprobs(logits, torch.tensor([[1]]), temperature=0.5)
    assert entropy.item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)))
    assert logprobs.item() == pytest.approx(math.log(0.9), abs=1e-12)
    logprobs.sum().backward()
    assert logits.grad.flatten().tolist() == pytest.approx([-0.2, 0.2], abs=1e-12)


@pytest.mark.parametrize("T", [0.3, 1.0, 2.5])
def test_tempered_values_and_gradient_match_the_naive_reference(T):
    logits, ids = _case(B=2, S=6, V=41)
    upstream = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    x = logits.clone().requires_grad_(True)
    ent, lp = entropy_and_logprobs(x, ids, chunk_size=5, temperature=T)
    (lp * upstream).sum().backward()
    y = logits.double().requires_grad_(True)
    ref_ent, ref_lp = _naive(y / T, ids)
    (ref_lp * upstream.double()).sum().backward()
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=1e-5, atol=1e-6)
    if T == 1.0:  # the default path, bit for bit
        assert torch.equal(lp, entropy_and_logprobs(logits, ids, chunk_size=5)[1])
    x64 = logits[:1, :2, :5].double().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: entropy_and_logprobs(z, ids[:1, :2] % 5, temperature=T)[1], (x64,)
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_a_temperature_that_is_no_positive_number_is_refused(bad):
    logits, ids = _case()
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        entropy_and_logprobs(logits, ids, temperature=bad)


def test_minus_inf_logits_are_probability_zero():
    # a masked vocabulary entry must act as if absent: same as the V = 2 case above
    logits = torch.tensor([[[0.0, -math.inf, math.log(3.0)]]], requires_grad=True)
    entropy, logprobs = entropy_and_logprobs(logits, torch.tensor([[2]]))
    assert entropy.item() == pytest.approx(
        -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6
    )
    assert logprobs.item() == pytest.approx(math.log(0.75), abs=1e-6)
    logprobs.sum().backward()
    # d log p(y) / dz = onehot(y) - p = [-1/4, 0, 1/4]
    assert torch.allclose(logits.grad, torch.tensor([[[-0.25, 0.0, 0.25]]]), atol=1e-6)


# ---------------------------------------------------------------------------- reference


def test_matches_naive_fp32():
    logits, ids = _case(dtype=torch.float32)
    entropy, logprobs = entropy_and_logprobs(logits, ids, chunk_size=4)
    ref_h, ref_lp = _naive(logits, ids)
    assert entropy.dtype == logprobs.dtype == torch.float32
    # fp32 accumulation over V = 37 terms of size <= ~10: errors of a few ulp of 10
    assert torch.allclose(entropy.double(), ref_h, atol=1e-5, rtol=0)
    assert torch.allclose(logprobs.double(), ref_lp, atol=1e-5, rtol=0)


def test_matches_naive_bf16_inputs():
    logits, ids = _case(dtype=torch.bfloat16, V=301)
    entropy, logprobs = entropy_and_logprobs(logits, ids, chunk_size=6)
    assert entropy.dtype == logprobs.dtype == torch.float32
    # bf16 -> fp32 is exact, so against the reference on the SAME bf16 values the only
    # error is fp32 accumulation (V = 301 terms): the fp32 tolerance applies.
    ref_h, ref_lp = _naive(logits, ids)
    assert torch.allclose(entropy.double(), ref_h, atol=2e-5, rtol=0)
    assert torch.allclose(logprobs.double(), ref_lp, atol=2e-5, rtol=0)
    # A bf16 softmax would be off by ~1e-2 (8 mantissa bits); show we are far better than that
    # by comparing with the bf16-rounded reference error scale.
    bf16_lp = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert (bf16_lp.double() - ref_lp).abs().max() > 10 * (logprobs.double() - ref_lp).abs().max()


def test_fp64_inputs_are_exact():
    logits, ids = _case(dtype=torch.float64)
    entropy, logprobs = entropy_and_logprobs(logits, ids, chunk_size=3)
    ref_h, ref_lp = _naive(logits, ids)
    assert torch.allclose(entropy, ref_h, atol=1e-12) and torch.allclose(
        logprobs, ref_lp, atol=1e-12
    )


def test_large_common_offset_keeps_entropy_accurate():
    # exp(z) would overflow without the max shift; lse - E[z] would cancel badly in fp32.
    logits, ids = _case(dtype=torch.float64)
    shifted = (logits + 1000.0).float()
    entropy, logprobs = entropy_and_logprobs(shifted, ids)
    ref_h, ref_lp = _naive(shifted, ids)
    assert torch.isfinite(entropy).all()
    # inputs near 1000 carry fp32 spacing 6e-5, which the reference sees too
    assert torch.allclose(entropy.double(), ref_h, atol=1e-4)
    assert torch.allclose(logprobs.double(), ref_lp, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_size_does_not_change_results(dtype):
    logits, ids = _case(B=4, S=9, V=53, dtype=dtype)
    outs = [entropy_and_logprobs(logits, ids, chunk_size=c) for c in (1, 7, 36, 10_000)]
    for h, lp in outs[1:]:
        # rows are reduced independently: the chunk size changes nothing, bit for bit
        assert torch.equal(h, outs[0][0]) and torch.equal(lp, outs[0][1])


def test_strided_input_equals_contiguous():
    logits, ids = _case(B=3, S=8, V=29)
    sliced = logits[:, :-1]  # not flattenable without a copy
    assert not sliced.is_contiguous()
    for chunk in (1, 4, 5, 100):
        h, lp = entropy_and_logprobs(sliced, ids[:, 1:], chunk_size=chunk)
        h2, lp2 = entropy_and_logprobs(sliced.contiguous(), ids[:, 1:], chunk_size=chunk)
        assert torch.equal(h, h2) and torch.equal(lp, lp2)
    # transposed vocab stride too
    t = logits.transpose(0, 2).contiguous().transpose(0, 2)
    assert torch.equal(
        entropy_and_logprobs(t, ids, chunk_size=3)[1], entropy_and_logprobs(logits, ids)[1]
    )


# ---------------------------------------------------------------------------- autograd


def test_entropy_has_no_grad_and_logprobs_do():
    logits, ids = _case()
    logits.requires_grad_(True)
    entropy, logprobs = entropy_and_logprobs(logits, ids)
    assert not entropy.requires_grad and entropy.grad_fn is None
    assert logprobs.requires_grad
    with torch.no_grad():
        _, lp = entropy_and_logprobs(logits, ids)
    assert not lp.requires_grad


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_logprob_gradient_matches_autograd_reference_fp32(chunk):
    logits, ids = _case(B=2, S=6, V=41)
    upstream = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    x = logits.clone().requires_grad_(True)
    _, lp = entropy_and_logprobs(x, ids, chunk_size=chunk)
    (lp * upstream).sum().backward()
    y = logits.clone().requires_grad_(True)
    ref = torch.log_softmax(y, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (ref * upstream).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.allclose(x.grad, y.grad, atol=1e-6)


def test_logprob_gradient_bf16_and_strided():
    logits, ids = _case(B=2, S=7, V=23, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    _, lp = entropy_and_logprobs(x[:, :-1], ids[:, 1:], chunk_size=5)
    lp.sum().backward()
    y = logits.float().requires_grad_(True)
    torch.log_softmax(y[:, :-1], -1).gather(-1, ids[:, 1:].unsqueeze(-1)).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert (x.grad[:, -1] == 0).all()  # the dropped last position gets no gradient
    # computed in fp32, rounded once to bf16 (relative 2^-8) at the end
    assert torch.allclose(x.grad.float(), y.grad, atol=4e-3, rtol=1e-2)


def test_gradcheck_fp64():
    logits, ids = _case(B=2, S=3, V=5, dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: entropy_and_logprobs(z, ids, chunk_size=2)[1], (x,))


def test_align_to_tokens():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    out = align_to_tokens(x)
    assert out.tolist() == [[0.0, 1.0, 2.0], [0.0, 3.0, 4.0]]
    out.sum().backward()
    assert x.grad.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert align_to_tokens(torch.zeros(2, 0)).shape == (2, 1)


def test_alignment_contract_end_to_end():
    # position t holds log p(token t | logits at t - 1); position 0 holds 0
    logits, ids = _case(B=2, S=6, V=11)
    _, lp = entropy_and_logprobs(logits[:, :-1], ids[:, 1:])
    aligned = align_to_tokens(lp)
    ref = torch.log_softmax(logits.double(), -1)
    for b in range(2):
        assert aligned[b, 0].item() == 0.0
        for t in range(1, 6):
            assert aligned[b, t].item() == pytest.approx(ref[b, t - 1, ids[b, t]].item(), abs=1e-5)


# ---------------------------------------------------------------------------- validation


def test_validation_messages():
    logits, ids = _case(B=2, S=3, V=5)
    with pytest.raises(ValueError, match=r"target_ids must be in \[0, 5\).*found 5"):
        entropy_and_logprobs(logits, torch.full((2, 3), 5))
    with pytest.raises(ValueError, match="found -1"):
        entropy_and_logprobs(logits, torch.full((2, 3), -1))
    with pytest.raises(ValueError, match=r"target_ids has shape \(2, 4\)"):
        entropy_and_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="target_ids must be an integer"):
        entropy_and_logprobs(logits, ids.float())
    with pytest.raises(ValueError, match="logits must be a 3-D"):
        entropy_and_logprobs(logits[0], ids[0])
    with pytest.raises(ValueError, match="logits must be floating"):
        entropy_and_logprobs(ids.unsqueeze(-1), ids)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_and_logprobs(logits, ids, chunk_size=0)
    with pytest.raises(ValueError, match="different devices"):
        entropy_and_logprobs(logits.to("meta"), ids)
    bad = logits.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"position \(b=1, s=2\)"):
        entropy_and_logprobs(bad, ids)
    with pytest.raises(ValueError, match="logits must be finite"):
        entropy_and_logprobs(torch.full((1, 1, 3), -math.inf), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="x must be a 2-D"):
        align_to_tokens(torch.zeros(3))


@pytest.mark.parametrize("offset", [1e3, 1e4])
def test_large_logit_offset_keeps_logprobs_and_gradient_exact(offset):
    """log p = (z_y - m) - log s: a large common offset (which the log-softmax removes) must
    not cost precision. The old form z_y - (m + log s) erred by 4.8e-4 at 1e4 in fp32."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 5, 50, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 50, (2, 5), generator=g)
    # The reference sees the fp32-rounded logits, so only the kernel's own error is measured.
    ref_in = (base + offset).float().double().requires_grad_(True)
    ref = torch.log_softmax(ref_in, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    weights = torch.randn(2, 5, generator=g, dtype=torch.float64)
    (ref * weights).sum().backward()
    logits = (base + offset).float().requires_grad_(True)
    _, lp = entropy_and_logprobs(logits, targets)
    (lp * weights.float()).sum().backward()
    assert (lp.double() - ref.detach()).abs().max() < 1e-5
    assert (logits.grad.double() - ref_in.grad).abs().max() < 1e-5


def test_kernel_leaves_the_callers_logits_untouched():
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(3, 4, 40, generator=g) * 5).to(dtype)
        logits[0, 0, :3] = float("-inf")
        logits.requires_grad_(True)
        before = logits.detach().clone()
        ent, lp = entropy_and_logprobs(
            logits, torch.randint(3, 40, (3, 4), generator=g), chunk_size=5
        )
        assert torch.equal(logits.detach(), before)
        lp.sum().backward()
        assert torch.equal(logits.detach(), before)
