"""Data-parallel gradient reduction of HFBackend: 2 gloo ranks on CPU."""

from types import SimpleNamespace

import pytest
import torch

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.hf import HFBackend, HFBackendConfig
from nemo_d3s.distributed.launch import run_on_gloo_ranks
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

ADVANTAGES = torch.tensor([1.0, -0.5, 2.0, -1.5])


def _backend():
    return HFBackend(HFBackendConfig(model="tiny-random", device="cpu", seed=0, lr=1e-3))


def _batch(b):
    return b.generate(
        ["What is 2+2?", "Say hi"], 2, GenerationConfig(max_new_tokens=8), seed=0
    ).batch


def _loss_fn(batch, rows_of_rank):
    # A SUM over this rank's rows; the backend divides by the GLOBAL token count (_D), so
    # rank contributions add up to the full-batch loss.
    def fn(lp, rows):
        global_rows = rows_of_rank[rows]
        mask = batch.response_mask[global_rows]
        return -(ADVANTAGES[global_rows, None] * lp * mask).sum()

    return fn


def _D(batch):
    return float(batch.response_mask.sum())


def _rank(rank, splits, expected):
    out = []
    for split in splits:
        b = _backend()
        batch = _batch(b)
        rows = torch.tensor(split[rank], dtype=torch.long)
        b.accumulate_gradients(
            batch.select(rows), _loss_fn(batch, rows), micro_batch_size=1, denominator=_D(batch)
        )
        ok = all(
            torch.allclose(p.grad, e, atol=1e-6, rtol=1e-4) for p, e in zip(b.params, expected)
        )
        # Then a full step: every rank must end with identical parameters.
        b.optimizer.zero_grad()
        metrics = b.train_step(
            batch.select(rows), _loss_fn(batch, rows), micro_batch_size=2, denominator=_D(batch)
        )
        out.append(
            {"ok": ok, "grad_norm": metrics["grad_norm"], "params": [p.detach() for p in b.params]}
        )
    return out


SPLITS = {"halves": [[0, 1], [2, 3]], "one_rank_empty": [[0, 3, 1, 2], []]}


def test_dp_gradients_equal_single_process_full_batch():
    ref = _backend()
    batch = _batch(ref)
    all_rows = torch.arange(len(batch))
    ref.accumulate_gradients(
        batch, _loss_fn(batch, all_rows), micro_batch_size=4, denominator=_D(batch)
    )
    expected = [p.grad.clone() for p in ref.params]
    ref.optimizer.zero_grad()
    ref_norm = ref.train_step(
        batch, _loss_fn(batch, all_rows), micro_batch_size=4, denominator=_D(batch)
    )["grad_norm"]

    # One launch runs every split (starting ranks dominates the test's time).
    per_rank = run_on_gloo_ranks(_rank, 2, list(SPLITS.values()), expected, timeout=WAIT_S)
    for k, name in enumerate(SPLITS):
        results = [per_rank[r][k] for r in range(2)]
        assert all(r["ok"] for r in results), (
            f"{name}: DP-reduced gradients differ from the full batch's"
        )
        for r in results:
            assert r["grad_norm"] == pytest.approx(ref_norm, rel=1e-5), name
        # Ranks must stay bit-identical replicas. (Against the single-process update only up
        # to Adam's first step, lr * g / (|g| + eps), which amplifies rounding in tiny grads.)
        for p, q in zip(results[0]["params"], results[1]["params"]):
            assert torch.equal(p, q), name


def _average_rank(rank, bf16_grads, fp32_grads):
    """HFBackend._average_grads on one bf16 and one fp32 parameter (what it reads of the
    backend: ``params`` and ``groups.dp`` / ``dp_size``)."""
    params = []
    for grads in (bf16_grads, fp32_grads):
        p = torch.nn.Parameter(torch.zeros_like(grads[rank]))
        p.grad = grads[rank].clone()
        params.append(p)
    groups = SimpleNamespace(dp=None, dp_size=len(bf16_grads))
    HFBackend._average_grads(SimpleNamespace(params=params, groups=groups))
    return [p.grad for p in params]


def test_bf16_gradients_are_averaged_in_fp32():
    """3 ranks: the mean of the ranks' bf16 gradients is their exact fp32 sum / 3, rounded to
    bf16 (as Megatron's grad_reduce_in_fp32). A bf16 all-reduce rounds after each add and
    after the division, and differs (with 2 ranks it does not: one add, and / 2 is exact).
    Three bf16 values of one element's scale add up exactly in fp32, in any order."""
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-4, 0, 4096).unsqueeze(0)
    bf16 = (torch.randn(3, 4096, generator=g) * scale).to(torch.bfloat16)
    fp32 = torch.randn(3, 64, generator=g)
    want_bf16 = (bf16.float().sum(0) / 3).to(torch.bfloat16)
    in_bf16 = (bf16[0] + bf16[1] + bf16[2]) / 3  # what a bf16 all-reduce computes
    assert not torch.equal(in_bf16, want_bf16)  # so the test below can fail
    for got_bf16, got_fp32 in run_on_gloo_ranks(
        _average_rank, 3, list(bf16), list(fp32), timeout=WAIT_S
    ):
        assert got_bf16.dtype == torch.bfloat16 and torch.equal(got_bf16, want_bf16)
        # fp32: gloo adds in its own order; 3 values of size ~1 round by at most ~4e-7
        torch.testing.assert_close(got_fp32, fp32.sum(0) / 3, rtol=0, atol=1e-6)
