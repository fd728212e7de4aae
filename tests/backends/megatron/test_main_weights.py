"""The Megatron backend's plain optimizer on bf16 parameters (``distributed_optimizer=false``
on CUDA) keeps fp32 main weights: updates far below a bf16 weight's spacing add up instead of
rounding away, and the bf16 parameters are the fp32 AdamW's weights rounded."""

from __future__ import annotations

import pytest
import torch

from nemo_d3s.backends.megatron.main_weights import MainWeightsAdamW
from nemo_d3s.backends.megatron.optimizer import build_optimizer
from nemo_d3s.backends.megatron.optimizer_state import optimizer_step
from _limits import WAIT_S  # noqa: E402

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


# ---------------------------------------------------------------- fp32 gradient accumulation
# Issue 30, item 6: the plain path on bf16 parameters accumulated the micro-batches'
# gradients in bf16 and all-reduced them over DP in bf16 (8 significant bits: a micro-batch
# 1000x smaller than another vanishes from the sum). Megatron's DDP accumulates and reduces in
# fp32 (``grad_reduce_in_fp32=True``); so does MainWeightsAdamW's main_grad now.
MICRO_BATCHES = 8


def _dp_reduced_grad(rank: int):
    import torch.distributed as dist

    from nemo_d3s.backends.megatron.optimizer import finalize_grads
    from nemo_d3s.distributed.groups import ParallelGroups

    torch.manual_seed(0)  # the same weights on both ranks
    model = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    _, opt = build_optimizer(model, lr=LR, distributed_optimizer=False)
    g = torch.Generator().manual_seed(100 + rank)
    reference = torch.zeros(8, 16, dtype=torch.float32)  # this rank's sum, in fp32
    for k in range(MICRO_BATCHES):
        scale = 1.0 if k % 2 == 0 else 1e-3  # small micro-batches round away in bf16
        x = (torch.randn(4, 16, generator=g) * scale).bfloat16()
        # the bf16 gradient this micro-batch contributes (a pass that accumulates nothing)
        (alone,) = torch.autograd.grad(model(x).float().sum(), model.weight)
        reference += alone.float()
        model(x).float().sum().backward()  # accumulates, as the schedule's backward does
    dist.all_reduce(reference)  # the slow obvious reference: fp32 sum over DP
    reference /= dist.get_world_size()
    finalize_grads(model, ParallelGroups(dp=dist.group.WORLD, global_rank=rank))
    w = model.weight
    reduced = w.main_grad if getattr(w, "main_grad", None) is not None else w.grad
    # what bf16 accumulation gives on the same gradients (to show the test can fail)
    return {"reduced": reduced.clone(), "reference": reference, "grad": w.grad}


@pytest.mark.distributed
def test_dp_reduced_gradient_of_bf16_parameters_is_the_fp32_sum():
    from nemo_d3s.distributed import run_on_gloo_ranks

    res = run_on_gloo_ranks(_dp_reduced_grad, 2, timeout=WAIT_S)
    for x in res:
        torch.testing.assert_close(x["reduced"].float(), x["reference"], rtol=1e-6, atol=1e-9)
        assert x["reduced"].dtype == torch.float32 and x["grad"] is None
    assert torch.equal(res[0]["reduced"], res[1]["reduced"])
    # bf16 would be off: rounding the fp32 answer to bf16 alone moves it by > 1e-4 relative
    ref = res[0]["reference"]
    assert ((ref.bfloat16().float() - ref).abs() / ref.abs().clamp_min(1e-12)).max() > 1e-4


def test_a_hand_worked_bf16_sum_keeps_the_small_gradient():
    # 1 + 2^-9 is not a bf16 number (spacing at 1 is 2^-7): bf16 accumulation of the two
    # backward passes gives 1.0, the fp32 main_grad 1 + 2^-9 exactly.
    p = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    opt = MainWeightsAdamW([p], lr=LR)
    (p * 1.0).sum().backward()
    (p * 2.0**-9).sum().backward()
    assert p.grad is None and p.main_grad.dtype == torch.float32
    assert p.main_grad.item() == 1.0 + 2.0**-9
    opt.zero_grad(set_to_none=True)
    assert getattr(p, "main_grad", None) is None


def _bucketed_average(rank: int):
    import torch.distributed as dist

    from nemo_d3s.backends.megatron.optimizer import _average

    # rank r's gradients: 1 + r, of sizes 3, 5 (fp32) and 4 (bf16); a 24-byte bucket holds
    # the 3 (12 bytes) alone, since 3 + 5 floats pass it; the 5 (20 bytes) is a bucket too
    grads = [torch.full((3,), 1.0 + rank), torch.full((5,), 1.0 + rank)]
    grads.append(torch.full((4,), 1.0 + rank, dtype=torch.bfloat16))
    calls = []
    real = dist.all_reduce

    def counting(t, *args, **kwargs):
        calls.append((t.numel(), t.dtype))
        return real(t, *args, **kwargs)

    dist.all_reduce = counting
    try:
        _average(grads, dist.group.WORLD, 2, bucket_bytes=24)
    finally:
        dist.all_reduce = real
    return {"grads": [g.tolist() for g in grads], "calls": calls}


@pytest.mark.distributed
def test_the_dp_average_sums_in_buckets():
    """The plain path's DP average all-reduces a bounded flat copy at a time (it copied every
    gradient at once: 4 bytes a parameter more at the reduce); hand-worked: ranks holding 1 and
    2 average to 1.5 in every bucket."""
    from nemo_d3s.distributed import run_on_gloo_ranks

    res = run_on_gloo_ranks(_bucketed_average, 2, timeout=WAIT_S)
    for x in res:
        assert x["grads"] == [[1.5] * 3, [1.5] * 5, [1.5] * 4]
        assert x["calls"] == [(3, torch.float32), (5, torch.float32), (4, torch.bfloat16)]
