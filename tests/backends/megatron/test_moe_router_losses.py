"""megatron-core's router losses (load-balancing and z, coefficients 0.1) on the Megatron
backend count real tokens only: right padding to ``width_quantum``, the ``allgather``
dispatcher's common width, dummy rows and the zero-weight micro-batches that keep EP ranks in
step enter neither loss nor the gradient (``backends/megatron/router_losses.py``).

Advantages are 0, so the policy-gradient term is exactly 0 and ``grad_norm`` is the router
losses' alone. Tiny random Qwen3-MoE (top-2 of 4 experts, 2 layers) on gloo ranks; rows 0-5 of
12, 7, 9, 4, 8, 11 tokens (``_tiny_hf.tiny_batch``). The router losses are per micro-batch,
so every comparison keeps the rows that share a micro-batch. Tolerances: the same tokens
through the same float32 ops, only the matmuls' shapes (padding), the TP / CP split and the
order of the sums over ranks differ: rel 1e-6 (measured <= 6e-8, float32's epsilon is
1.2e-7); against transformers' forward of each row alone, another implementation of the same
float32 ops: rel 1e-5 (measured <= 6e-8; ``test_moe.py`` compares log-probs at 1e-4).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "distributed"))
from _launch import run_ranks  # noqa: E402
from _grpo_loss import denominator, grpo_loss_fn  # noqa: E402
from _tiny_hf import LENGTHS, make_tiny_hf, tiny_batch  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

COEFF = 0.1
TIGHT = 1e-6
HF = 1e-5
KEYS = ("grad_norm", "moe_load_balancing_loss", "moe_z_loss")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("router_losses") / "q", "qwen3_moe", layers=2))


def _rank(rank, folder, rows_of, mbs, kw):
    """One train step of rows ``rows_of[dp rank]`` at micro-batch size ``mbs``; the step's
    grad_norm and logged router losses."""
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    batch, adv, noise, keep = tiny_batch()
    adv = torch.zeros_like(adv)  # only the router losses have a gradient
    cfg = {"moe_aux_loss_coeff": COEFF, "moe_z_loss_coeff": COEFF, **kw}
    pol = MegatronBackend(
        MegatronBackendConfig(
            model=folder, device="cpu", lr=1e-2, adam_eps=1e-3, grad_clip=0.0, **cfg
        )
    )
    rows = torch.tensor(rows_of[ps.get_data_parallel_rank()], dtype=torch.long)
    local = batch.select(rows)
    lp = pol.score(local, with_entropy=False, micro_batch_size=mbs).logprobs
    loss = grpo_loss_fn(local, lp + noise[rows], adv[rows], keep[rows], "token_mean")
    m = pol.train_step(local, loss, mbs, denominator=denominator(keep, "token_mean"))
    return {k: v for k, v in m.items() if k in KEYS}


def _run(folder, world, rows_of, mbs=1, **kw):
    """Every rank's metrics: grad_norm (the same on every rank) and the router losses summed
    over DP ranks (each rank logs its share of the step's mean)."""
    out = run_ranks(_rank, world, folder, rows_of, mbs, kw, megatron=False, timeout=WAIT_S)
    assert len(rows_of) in (1, world)  # one model copy, or each rank one
    # (an all-padding micro-batch's load-balancing loss would be 0 / 0)
    assert math.isfinite(out[0]["grad_norm"])
    assert all(o["grad_norm"] == out[0]["grad_norm"] for o in out)
    dp = out[: len(rows_of)]
    summed = {k: sum(o[k] for o in dp) for k in KEYS[1:] if k in out[0]}
    return {"grad_norm": out[0]["grad_norm"], **summed}


ALL = [[0, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def exact(folder):
    """One row per micro-batch at width_quantum 0 (each row at its own length: no padding)
    and 64 (every row padded to 64 columns)."""
    return {q: _run(folder, 1, ALL, width_quantum=q) for q in (0, 64)}


def _close(got, want, rel=TIGHT):
    assert set(got) == set(want), (got, want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=rel), (k, got, want)


def test_router_losses_do_not_depend_on_the_padding_width(folder, exact):
    """The review's case: width_quantum 64 fed 384 positions for 51 real tokens, and gave
    grad_norm 4.101, load-balancing 1.567, z 4.286 against 1.352, 1.310, 2.960 at 0. Also
    under full activation recomputation, whose backward re-runs each layer's forward: its
    routers get the masks of the forwards they recompute."""
    assert exact[0]["grad_norm"] > 0 and exact[0]["moe_load_balancing_loss"] > 0
    _close(exact[64], exact[0])
    _close(_run(folder, 1, ALL, width_quantum=64, gradient_checkpointing=True), exact[0])


def _hf_reference(folder):
    """The slow reference: transformers' router logits of each row fed alone, unpadded (one
    micro-batch per row). Per row and layer, over its T real tokens, megatron-core's formulas
    (0.16.1 moe_utils.py switch_load_balancing_loss_func, z_loss_func): load balancing
    E / (k T^2) sum_e (sum_t p_te)(sum_t [e in top-k of t]), z mean_t logsumexp_t^2; logged: their
    mean over rows and layers; the gradient: of COEFF x their sum / rows (megatron-core's
    1 / micro-batches scale)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    seen = []
    for r in routers:
        r.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    batch = tiny_batch()[0]
    aux, z = [], []
    for row, n in enumerate(LENGTHS):
        seen.clear()
        model(input_ids=batch.input_ids[row : row + 1, :n])
        for logits in seen:
            assert logits.shape == (n, E)
            p = torch.softmax(logits.float(), dim=-1)
            top = torch.zeros_like(p).scatter(1, p.topk(k, dim=1).indices, 1.0)
            aux.append((p.sum(0) * top.sum(0)).sum() * E / (k * n * n))
            z.append(torch.logsumexp(logits, dim=-1).square().mean())
    aux, z = torch.stack(aux), torch.stack(z)
    (COEFF * (aux.sum() + z.sum()) / len(LENGTHS)).backward()
    grads = [p.grad.double().square().sum() for p in model.parameters() if p.grad is not None]
    return {
        "grad_norm": float(torch.stack(grads).sum().sqrt()),
        "moe_load_balancing_loss": float(aux.detach().mean()),
        "moe_z_loss": float(z.detach().mean()),
    }


def test_router_losses_of_padded_rows_equal_the_unpadded_reference(folder, exact):
    """Each row padded to 64 columns gives the losses and the gradient norm transformers'
    forward of the row alone gives under megatron-core's formulas."""
    _close(exact[64], _hf_reference(folder), rel=HF)


def test_filler_micro_batches_wider_rows_and_dummy_rows_enter_no_router_loss(folder, exact):
    """DP 2 x EP 2 with the allgather dispatcher: every micro-batch widened to the group's
    widest, rank 1's rows [4, 5] followed by two all-padding micro-batches (rank 0 runs four).
    They equal the one-rank step. At micro-batch size 2, rows [0, 1], [2, 3] | [4]: rank 1's
    micro-batch gets a dummy row (allgather: two rows everywhere) and a filler; the one-rank
    step of rows 0-4 runs the same three micro-batches."""
    ep = dict(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather")
    _close(_run(folder, 2, [[0, 1, 2, 3], [4, 5]], **ep), exact[0])
    five = _run(folder, 1, [[0, 1, 2, 3, 4]], mbs=2)
    _close(_run(folder, 2, [[0, 1, 2, 3], [4]], mbs=2, **ep), five)


@pytest.mark.parametrize("quantum", [0, 64])
@pytest.mark.parametrize(
    "layout",
    [dict(tensor_model_parallel_size=2, sequence_parallel=True), dict(context_parallel_size=2)],
    ids=["tp2_sp", "cp2"],
)
def test_sequence_and_context_parallel_ranks_mask_their_own_tokens(folder, exact, layout, quantum):
    """TP 2 with sequence parallelism (each rank's routers see its half of a row's positions)
    and CP 2 (its two zigzag quarters). Width quantum 0: each row at its length rounded up to
    2 (TP) or 4 (CP) and split unevenly (a row of 7 tokens: 4 and 3); 64: all real tokens on
    one rank (TP rank 0, CP rank 0's first quarter), padding only on the other. Both losses
    and the gradient equal the one-rank, unpadded step's: the load-balancing parts and the z
    loss's (megatron-core's mean of each rank's own token mean, weighted by each rank's share
    of the real tokens) add up over the ranks."""
    _close(_run(folder, 2, ALL, width_quantum=quantum, **layout), exact[0])
