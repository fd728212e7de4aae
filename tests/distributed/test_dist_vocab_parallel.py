"""Vocab-parallel entropy / log-prob against a single-process reference on the full vocabulary.

One launch of 4 gloo ranks with Megatron groups TP2 x DP2 runs every case; the same ranks
also act as one TP4 group (the world group) for the 4-way cases. Each rank returns its
outputs and its shard's gradient; the parent compares them with

- a slow obvious reference: float64 ``log_softmax`` over the full (unpadded) vocabulary,
  entropy ``-sum p log p``, autograd gradient of ``sum_t w_t log p_t``;
- the core single-process function ``core.entropy.entropy_and_logprobs``.

Tolerances: fp32 logits -> 1e-5 (fp32 accumulation in a different summation order than
the fp64 reference, values O(1..10)); bf16 logits are compared with the reference computed
on the SAME bf16-rounded values, so only fp32 accumulation differs (same 1e-5 on the
outputs); the bf16 gradient is stored in bf16, so it matches to bf16 rounding (rel 2^-8).
"""

from __future__ import annotations

import math

import pytest
import torch

from _launch import run_ranks

pytestmark = pytest.mark.distributed

B, S = 3, 5


def _case_list():
    """name -> (tp kind, shard widths, vocab_size, dtype, transposed, with -inf)."""
    return {
        "even_fp32": ("tp2", (6, 6), 12, torch.float32, False, False),
        "bf16": ("tp2", (6, 6), 12, torch.bfloat16, False, False),
        "uneven_padded": ("tp2", (5, 3), 6, torch.float32, False, False),  # rank 1: 1 valid + 2 pad
        "all_pad_shard": ("tp2", (6, 2), 6, torch.float32, False, False),  # rank 1: only padding
        "transposed_neg_inf": ("tp2", (4, 4), 8, torch.float32, True, True),
        "tp4_uneven": (
            "tp4",
            (3, 4, 2, 3),
            11,
            torch.float32,
            False,
            False,
        ),  # last: 2 valid + 1 pad
        "tp4_bf16": ("tp4", (4, 4, 4, 4), 16, torch.bfloat16, True, False),
        "tempered_uneven": ("tp2", (5, 3), 6, torch.float32, False, False),
        "tp4_tempered_neg_inf": ("tp4", (3, 4, 2, 3), 11, torch.float32, True, True),
    }


# the sampler's temperature of a case (1 where not named): softmax(logits / T) is scored
TEMPERATURE = {"tempered_uneven": 0.6, "tp4_tempered_neg_inf": 1.7}


def _data(name, dp_rank):
    """Full padded logits [B, S, sum widths] fp32, targets [B, S], upstream grad weights.
    Deterministic per (case, data-parallel rank): every TP rank builds the same tensors."""
    _, widths, vocab, dtype, _, neg_inf = _case_list()[name]
    g = torch.Generator().manual_seed(1000 * dp_rank + sum(map(ord, name)))
    full = torch.randn(B, S, sum(widths), generator=g) * 3.0 + 2.0
    if neg_inf:
        full[0, 1, 2] = -math.inf  # a masked vocabulary entry
        full[1, :, 0] = -math.inf
    full = full.to(dtype).to(torch.float32)  # the values the rank will actually see
    targets = torch.randint(0, vocab, (B, S), generator=g)
    if neg_inf:
        targets[0, 0] = 3
        targets[1] = targets[1].clamp(min=1)  # keep targets off the -inf column
    w = torch.randn(B, S, generator=g, dtype=torch.float64)
    return full, targets, w


def _rank_vocab(rank):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed import vocab_parallel_entropy_and_logprobs

    out = {}
    for name, (kind, widths, vocab, dtype, transposed, _) in _case_list().items():
        if kind == "tp2":
            group, tp_rank, dp_rank = (
                ps.get_tensor_model_parallel_group(),
                ps.get_tensor_model_parallel_rank(),
                ps.get_data_parallel_rank(),
            )
        else:
            group, tp_rank, dp_rank = dist.group.WORLD, rank, 0
        full, targets, w = _data(name, dp_rank)
        start = sum(widths[:tp_rank])
        shard = full[..., start : start + widths[tp_rank]].to(dtype)
        if (
            transposed
        ):  # Megatron's [S, B, V/TP] buffer seen as [B, S, V/TP]: not viewable as [B*S, V]
            shard = shard.transpose(0, 1).contiguous().transpose(0, 1)
        shard = shard.detach().requires_grad_(True)
        before = shard.detach().clone()
        ent, lp = vocab_parallel_entropy_and_logprobs(
            shard,
            targets,
            group,
            vocab_size=vocab,
            chunk_size=4,
            temperature=TEMPERATURE.get(name, 1.0),
        )
        # The kernel works in place on its own buffers only: the caller's shard is untouched.
        assert torch.equal(shard.detach(), before), name
        assert not ent.requires_grad and lp.requires_grad
        assert ent.dtype == lp.dtype == torch.float32 and ent.shape == lp.shape == (B, S)
        (lp.double() * w).sum().backward()
        assert torch.equal(shard.detach(), before), name
        out[name] = (dp_rank, tp_rank, ent.detach(), lp.detach(), shard.grad.float())

    # Hand-worked case on the TP2 groups: z = [0, 0 | ln 2], V = 3 split 2 + 1, target 2.
    tp_rank = ps.get_tensor_model_parallel_rank()
    z = torch.tensor([0.0, 0.0]) if tp_rank == 0 else torch.tensor([math.log(2.0)])
    z = z.view(1, 1, -1).requires_grad_(True)
    ent, lp = vocab_parallel_entropy_and_logprobs(
        z, torch.tensor([[2]]), ps.get_tensor_model_parallel_group()
    )
    lp.sum().backward()
    out["hand"] = (tp_rank, float(ent), float(lp), z.grad.flatten().tolist())
    return out


def _reference(full, targets, vocab, w):
    z = full[..., :vocab].double().requires_grad_(True)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    ent = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (lp * w).sum().backward()
    grad = torch.cat(
        [z.grad, torch.zeros(*full.shape[:2], full.shape[2] - vocab, dtype=torch.float64)], -1
    )
    return ent.detach(), lp.detach(), grad


@pytest.fixture(scope="module")
def vocab_results():
    return run_ranks(_rank_vocab, 4, tp=2)


def test_matches_full_vocab_reference(vocab_results):
    from nemo_d3s.core.entropy import entropy_and_logprobs

    for name, (kind, widths, vocab, dtype, _, _) in _case_list().items():
        for rank, res in enumerate(vocab_results):
            dp_rank, tp_rank, ent, lp, grad = res[name]
            full, targets, w = _data(name, dp_rank)
            T = TEMPERATURE.get(name, 1.0)
            # of z = logits / T; the chain rule's 1/T takes the gradient back to the logits
            ref_ent, ref_lp, ref_grad = _reference(full / T, targets, vocab, w)
            ref_grad = ref_grad / T
            torch.testing.assert_close(
                ent.double(), ref_ent, rtol=1e-5, atol=1e-5, msg=f"{name} entropy rank {rank}"
            )
            torch.testing.assert_close(
                lp.double(), ref_lp, rtol=1e-5, atol=1e-5, msg=f"{name} logprob rank {rank}"
            )
            start = sum(widths[:tp_rank])
            ref_shard = ref_grad[..., start : start + widths[tp_rank]].float()
            tol = (
                dict(rtol=1.6e-2, atol=1e-3)
                if dtype == torch.bfloat16
                else dict(rtol=1e-5, atol=1e-6)
            )
            torch.testing.assert_close(grad, ref_shard, **tol, msg=f"{name} grad rank {rank}")
            # The core single-process function on the same (unpadded) values agrees too.
            core_ent, core_lp = entropy_and_logprobs(
                full[..., :vocab].to(dtype), targets, temperature=T
            )
            torch.testing.assert_close(ent, core_ent, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lp, core_lp, rtol=1e-5, atol=1e-5)


def test_identical_on_all_tp_ranks(vocab_results):
    for name, (kind, *_rest) in _case_list().items():
        members = [0, 1, 2, 3] if kind == "tp4" else None
        groups = [members] if members else [[0, 1], [2, 3]]
        for grp in groups:
            first = vocab_results[grp[0]][name]
            for r in grp[1:]:
                assert torch.equal(vocab_results[r][name][2], first[2]), name
                assert torch.equal(vocab_results[r][name][3], first[3]), name


def test_hand_worked_case(vocab_results):
    # p = [1/4, 1/4, 1/2]: H = 1.5 ln 2, log p(2) = -ln 2, d log p(2)/dz = [-1/4, -1/4, 1/2].
    grads = {}
    for res in vocab_results:
        tp_rank, ent, lp, grad = res["hand"]
        assert ent == pytest.approx(1.5 * math.log(2.0), rel=1e-6)
        assert lp == pytest.approx(-math.log(2.0), rel=1e-6)
        grads[tp_rank] = grad
    assert grads[0] == pytest.approx([-0.25, -0.25], abs=1e-7)
    assert grads[1] == pytest.approx([0.5], abs=1e-7)


def test_single_process_falls_back_to_core():
    from nemo_d3s.core.entropy import entropy_and_logprobs
    from nemo_d3s.distributed import vocab_parallel_entropy_and_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g)
    targets = torch.randint(0, 5, (2, 3), generator=g)
    ent, lp = vocab_parallel_entropy_and_logprobs(logits, targets, None, vocab_size=5)
    ref_ent, ref_lp = entropy_and_logprobs(logits[..., :5], targets)
    assert torch.equal(ent, ref_ent) and torch.equal(lp, ref_lp)
    with pytest.raises(ValueError, match="target_ids"):
        vocab_parallel_entropy_and_logprobs(logits, targets.float(), None)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_entropy_and_logprobs(logits, targets, None, vocab_size=9)


def test_shard_widths_travel_on_the_groups_collective_device(monkeypatch):
    """vocab_shard_range without a device gathers the widths on collective_device(group)
    (CUDA for NCCL, which takes no CPU tensors), not on a fixed CPU tensor."""
    import nemo_d3s.distributed.vocab_parallel as vp

    group, asked, used = object(), [], []
    monkeypatch.setattr(vp, "collective_device", lambda g: asked.append(g) or torch.device("cpu"))
    monkeypatch.setattr(vp, "group_rank", lambda g: 1)

    def fake_gather(n, g, device):
        used.append((g, device))
        return torch.tensor([5, n, 7])

    monkeypatch.setattr(vp, "all_gather_counts", fake_gather)
    assert vp.vocab_shard_range(6, group) == (5, 6, 18)
    assert asked == [group] and used == [(group, torch.device("cpu"))]
