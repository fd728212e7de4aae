"""HFBackend with packed sequences (``pack_sequences=true``) equals the unpacked backend:
per-token log-probs and entropy of every response token, the loss and the gradient, for the
model families the package loads (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k norms), at
one process and at DP 2 (gloo)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from nemo_d3s.backends.hf import HFBackend, HFBackendConfig
from nemo_d3s.backends.hf.packed import pack_batch
from nemo_d3s.distributed.launch import run_on_gloo_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron"))
from _limits import WAIT_S  # noqa: E402
from _tiny_hf import make_tiny_hf, tiny_batch  # noqa: E402

ARCHS = {"llama": False, "qwen2": True, "qwen3": False}  # arch -> tied embeddings


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {a: str(make_tiny_hf(root / a, a, tied=t)) for a, t in ARCHS.items()}


def _backend(folder, pack):
    cfg = HFBackendConfig(model=folder, device="cpu", seed=0, lr=1e-3, pack_sequences=pack)
    return HFBackend(cfg)


def _loss_fn(batch, adv, keep):
    def fn(lp, rows):
        return -(adv[rows, None] * lp * keep[rows, : lp.shape[1]]).sum()

    return fn


def _grads(b, batch, adv, keep, **kw):
    b.optimizer.zero_grad(set_to_none=True)
    sums = b.accumulate_gradients(batch, _loss_fn(batch, adv, keep), denominator=7.0, **kw)
    return float(sums["loss_sum"]), [p.grad.clone() for p in b.params], sums


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_equals_unpacked(folders, arch):
    batch, adv, _, keep = tiny_batch()
    plain, packed = _backend(folders[arch], False), _backend(folders[arch], True)
    assert packed.pack and not plain.pack
    # a budget of 27 tokens packs the 6 rows (51 tokens) into [12, 8, 7] and [11, 9, 4]
    packs = pack_batch(batch, 1, 27)
    assert [p.rows.tolist() for p in packs] == [[0, 4, 1], [5, 2, 3]]
    want = plain.score(batch, with_entropy=True, micro_batch_size=2)
    for kw in ({"micro_batch_tokens": 27}, {"micro_batch_size": 2}):
        got = packed.score(batch, with_entropy=True, **kw)
        resp = batch.response_mask
        torch.testing.assert_close(got.logprobs * resp, want.logprobs * resp, rtol=0, atol=2e-5)
        torch.testing.assert_close(got.entropy * resp, want.entropy * resp, rtol=0, atol=2e-5)
        assert not (got.logprobs * ~resp).any()  # only response tokens are scored
    # no padding at all
    assert got.stats["fed_tokens"] == got.stats["attended_tokens"] == batch.attention_mask.sum()
    loss_ref, grads_ref, _ = _grads(plain, batch, adv, keep, micro_batch_size=2)
    loss, grads, sums = _grads(packed, batch, adv, keep, micro_batch_size=1, micro_batch_tokens=27)
    assert sums["n_micro_batches"] == 2
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    for g, r in zip(grads, grads_ref):  # fp32 summation order: 1e-4 of the tensor's scale
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * float(r.abs().max()))


def test_positions_restart_per_row(folders):
    """The same pack fed without restarting positions (one long sequence) scores other
    numbers: the equality above is not a property of the batch."""
    batch, *_ = tiny_batch()
    b = _backend(folders["llama"], True)
    pack = pack_batch(batch, 1, 27)[0]
    ids = pack.pack(batch.input_ids).unsqueeze(0)
    with torch.no_grad():
        restart = b.model(input_ids=ids, position_ids=pack.position_ids().unsqueeze(0)).logits
        running = b.model(input_ids=ids).logits
    second = slice(int(pack.cu_seqlens[1]), pack.width)  # the second row's slot
    assert not torch.allclose(restart[0, second], running[0, second], atol=1e-3)
    torch.testing.assert_close(restart[0, : second.start], running[0, : second.start])


def _rank(rank, folder, splits, pack):
    batch, adv, _, keep = tiny_batch()
    rows = torch.tensor(splits[rank], dtype=torch.long)
    b = _backend(folder, pack)
    m = b.train_step(
        batch.select(rows),
        _loss_fn(batch.select(rows), adv[rows], keep[rows]),
        micro_batch_size=2,
        micro_batch_tokens=27 if pack else 0,
        denominator=7.0,
    )
    return {"loss": m["loss_sum"], "grad_norm": m["grad_norm"], "params": list(b.params)}


@pytest.mark.distributed
def test_dp2_packed_equals_one_process_unpacked(folders):
    batch, adv, _, keep = tiny_batch()
    ref = _backend(folders["llama"], False)
    m = ref.train_step(batch, _loss_fn(batch, adv, keep), micro_batch_size=2, denominator=7.0)
    splits = [[0, 2, 4], [1, 3, 5]]
    out = run_on_gloo_ranks(_rank, 2, folders["llama"], splits, True, timeout=WAIT_S)
    assert sum(r["loss"] for r in out) == pytest.approx(m["loss_sum"], rel=1e-5)
    for r in out:
        assert r["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-4)
    for p, q, w in zip(out[0]["params"], out[1]["params"], ref.params):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, w.detach(), rtol=1e-4, atol=1e-5)
