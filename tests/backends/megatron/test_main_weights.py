"""The Megatron backend's plain optimizer on bf16 parameters (``distributed_optimizer=false``
on CUDA) keeps fp32 main weights: updates far below a bf16 weight's spacing add up instead of
rounding away, and the bf16 parameters are the fp32 AdamW's weights rounded."""

from __future__ import annotations

import pytest
import torch

from nemo_d3s.backends.megatron.main_weights import MainWeightsAdamW
from nemo_d3s.backends.megatron.optimizer import build_optimizer
from nemo_d3s.backends.megatron.optimizer_state import optimizer_step

LR, STEPS = 1e-3, 20


def _grads(shape, n):
    g = torch.Generator().manual_seed(1)
    sign = torch.where(
        torch.rand(shape, generator=g) < 0.5, -1.0, 1.0
    )  # one sign per weight: updates add up
    return [(sign * (0.5 + torch.rand(shape, generator=g))).bfloat16() for _ in range(n)]


def test_small_updates_on_bf16_parameters_are_kept():
    # Weights in [0.5, 1): bf16 spacing 2^-8 ~ 3.9e-3 there, and AdamW moves each by ~LR = 1e-3
    # per step: plain AdamW on the bf16 tensors rounds every step back (nothing changes).
    w0 = (0.5 + 0.5 * torch.rand(16, 8, generator=torch.Generator().manual_seed(0))).bfloat16()
    model = torch.nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(w0)
    reference = torch.nn.Parameter(w0.float().clone())  # AdamW in fp32 on the same gradients
    ref_opt = torch.optim.AdamW([reference], lr=LR, weight_decay=0.01)
    plain = torch.nn.Parameter(w0.clone())  # what the plain path did: AdamW on the bf16 tensor
    plain_opt = torch.optim.AdamW([plain], lr=LR, weight_decay=0.01)
    _, opt = build_optimizer(model, lr=LR, weight_decay=0.01, distributed_optimizer=False)
    assert isinstance(opt, MainWeightsAdamW)
    for g in _grads(w0.shape, STEPS):
        model.weight.grad = g.clone()
        reference.grad = g.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        plain.grad = g.clone()
        plain_opt.step()
        assert model.weight.grad is None
    assert torch.equal(opt.main_of(model.weight), reference.detach())
    assert torch.equal(model.weight.detach(), reference.detach().bfloat16())
    moved = (model.weight.detach().float() - w0.float()).abs()
    assert (moved > 0).float().mean() > 0.9  # ~2e-2 of movement, ~5 bf16 steps
    assert optimizer_step(opt) == STEPS
    assert torch.equal(plain.detach(), w0)  # every update lost without main weights


def test_fp32_parameters_keep_plain_adamw():
    model = torch.nn.Linear(4, 4)
    _, opt = build_optimizer(model, lr=LR, distributed_optimizer=False)
    assert type(opt) is torch.optim.AdamW


def test_closure_is_refused():
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="closure"):
        MainWeightsAdamW([p], lr=LR).step(lambda: 0.0)
