"""Router replay and routing records on the Megatron backend (``backends/megatron/routing.py``)
against the HF backend's (``backends/hf/routing.py``), on gloo ranks.

A tiny random Qwen3-MoE (top-2 of 4 experts) scores and trains a batch carrying a routing that
is not its own (random expert sets; ``NO_EXPERT`` on each row's last real token and on one
whole row, where the router keeps its own choice). At EP 1, EP 2, TP 2 x EP 2 (sequence
parallel: each TP rank routes its 1/TP of the sequence), CP 2 x EP 2 (each CP rank its zigzag
chunks), PP 2 x VPP 2 x EP 2 (each chunk's layers), EP 2 under full activation recomputation
(the backward's recomputed forward replays too) the log-probs and entropies equal the HF
backend's under the same replay (1e-4, the MoE tests' tolerance) and differ from the unreplayed
ones; the routing each backend records (the routers' own choice on the replayed forward) is the
same expert sets; one train step gives the HF backend's replayed gradient norm (rel 1e-4) and
weights (atol 1e-5). The token order each router sees is checked by hand on a small case.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "distributed"))
from _launch import run_ranks  # noqa: E402
from _grpo_loss import denominator, grpo_loss_fn  # noqa: E402
from _tiny_hf import B, LENGTHS, make_tiny_hf, tiny_batch  # noqa: E402
from _limits import WAIT_S  # noqa: E402
from test_moe import _per_expert  # noqa: E402  (transformers' fused experts, per expert)

from nemo_d3s.core.routing import NO_EXPERT, expert_sets_differ  # noqa: E402

OPT = dict(lr=1e-2, adam_eps=1e-3, weight_decay=0.01, grad_clip=0.5)
MBS = 2
AGG = "token_mean"
HALVES = [[0, 1, 2, 3], [4, 5]]
LAYERS, EXPERTS, TOPK = 2, 4, 2


# ---------------------------------------------------------------------------- token order
class _Chunks:
    """A stand-in ContextParallel: this rank's positions along the length are ``keep``."""

    def __init__(self, keep):
        self.keep = torch.tensor(keep)

    def local(self, x, dim):
        return x.index_select(dim, self.keep)


def test_router_positions_by_hand():
    """Rows [2, 0] of a [B, 3] batch fed as b = 3 rows (one dummy) of width 4: the router sees
    [L, b] flattened, position row * 3 + column, -1 past the row's 3 columns and on the dummy
    row; SP keeps this TP rank's contiguous half of the sequence; CP the rank's positions."""
    from nemo_d3s.backends.megatron.batches import MicroBatch
    from nemo_d3s.backends.megatron.routing import router_positions

    mb = MicroBatch(torch.tensor([2, 0]), 3, 4)
    want = [6, 0, -1, 7, 1, -1, 8, 2, -1, -1, -1, -1]
    assert router_positions(mb, 3).tolist() == want
    assert (
        router_positions(mb, 3, tp_rank=1, tp_size=2, sequence_parallel=True).tolist() == (want[6:])
    )
    assert router_positions(mb, 3, tp_rank=1, tp_size=2).tolist() == want  # no SP: every token
    # a CP rank holding columns 0 and 3 (the zigzag chunks of 2 x CP = 4 at CP 2)
    assert router_positions(mb, 3, _Chunks([0, 3])).tolist() == [6, 0, -1, -1, -1, -1]


def _slow_positions(rows, b, width, seq_len, local_cols, tp_rank, tp_size, sp):
    """One token at a time: the router's order is column-major over this rank's columns."""
    cols = list(range(width)) if local_cols is None else list(local_cols)
    if sp and tp_size > 1:
        n = len(cols) // tp_size
        cols = cols[tp_rank * n : (tp_rank + 1) * n]
    out = []
    for c in cols:
        for j in range(b):
            real = j < len(rows) and c < seq_len
            out.append(rows[j] * seq_len + c if real else -1)
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda n: st.tuples(
            st.permutations(list(range(6))).map(lambda p: p[:n]),
            st.integers(n, n + 2),  # b: dummy rows after the real ones
            st.sampled_from([4, 8, 12]),  # width
            st.integers(2, 10),  # the batch's S
            st.booleans(),  # CP: keep the zigzag chunks 0 and 3 of 4
            st.sampled_from([(0, 1), (0, 2), (1, 2)]),  # (TP rank, TP)
            st.booleans(),  # sequence parallel
        )
    )
)
def test_router_positions_match_a_token_by_token_reference(case):
    from nemo_d3s.backends.megatron.batches import MicroBatch
    from nemo_d3s.backends.megatron.routing import router_positions

    rows, b, width, seq_len, cp, (tp_rank, tp), sp = case
    q = width // 4
    local = list(range(q)) + list(range(3 * q, width)) if cp else None
    mb = MicroBatch(torch.tensor(rows), b, width)
    got = router_positions(
        mb,
        seq_len,
        _Chunks(local) if cp else None,
        tp_rank=tp_rank,
        tp_size=tp,
        sequence_parallel=sp,
    )
    assert got.tolist() == _slow_positions(rows, b, width, seq_len, local, tp_rank, tp, sp)


def test_a_tap_routes_by_the_target_and_keeps_its_own_choice_where_none_is_given():
    from nemo_d3s.backends.megatron.routing import RouterTap

    def topk(scores, k, num_groups=None, group_topk=None):
        return torch.topk(scores, k=k, dim=1)

    scores = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.5, 0.1, 0.3, 0.1], [0.0, 0.2, 0.3, 0.5]])
    tap = RouterTap(0)
    probs, experts = tap.get_replay_topk(scores, 2, None, None, topk)
    assert experts.tolist() == [[1, 2], [0, 2], [3, 2]] and torch.equal(tap.own, experts)
    tap.target = torch.tensor([[0, 3], [NO_EXPERT, NO_EXPERT], [1, 0]])
    probs, experts = tap.get_replay_topk(scores, 2, None, None, topk)
    assert experts.tolist() == [[0, 3], [0, 2], [1, 0]]
    # the router's own scores of the experts it is given
    assert torch.equal(
        probs, torch.stack([scores[0, [0, 3]], scores[1, [0, 2]], scores[2, [1, 0]]])
    )
    assert tap.own.tolist() == [[1, 2], [0, 2], [3, 2]]
    # a row with part of its top-k: its own choice whole, never an expert twice (merging
    # [2, -1] with its own [0, 2] gave [2, 2])
    tap.target = torch.tensor([[0, 3], [2, NO_EXPERT], [NO_EXPERT, 0]])
    _, experts = tap.get_replay_topk(scores, 2, None, None, topk)
    assert experts.tolist() == [[0, 3], [0, 2], [3, 2]]
    tap.target = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="MoE layer 0 routes"):
        tap.get_replay_topk(scores, 2, None, None, topk)


# ---------------------------------------------------------------------------- against HF
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe_replay")
    return {
        2: str(make_tiny_hf(root / "q2", "qwen3_moe", layers=2)),
        4: str(make_tiny_hf(root / "q4", "qwen3_moe", layers=4)),
    }


def _routing(layers: int) -> torch.Tensor:
    """[B, S, layers, 2] int16: random expert sets; NO_EXPERT on each row's last real token,
    on row 4 and past each row's tokens."""
    batch = tiny_batch()[0]
    Bs, S = batch.input_ids.shape
    g = torch.Generator().manual_seed(11)
    r = torch.rand(Bs, S, layers, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
    r[~batch.attention_mask] = NO_EXPERT
    r[torch.arange(Bs), torch.tensor(LENGTHS) - 1] = NO_EXPERT
    r[4] = NO_EXPERT
    return r.to(torch.int16)


def _hf_reference(folder, layers):
    from nemo_d3s.backends.hf.backend import HFBackend
    from nemo_d3s.backends.hf.config import HFBackendConfig

    batch, adv, noise, keep = tiny_batch()
    replay = dataclasses.replace(batch, routed_experts=_routing(layers))
    hf = HFBackend(HFBackendConfig(model=folder, device="cpu", autocast=None, **OPT))
    plain = hf.score(batch, with_entropy=True, micro_batch_size=MBS)
    sc = hf.score(replay, with_entropy=True, micro_batch_size=MBS)
    old_lp = sc.logprobs + noise
    metrics = hf.train_step(
        replay, grpo_loss_fn(batch, old_lp, adv, keep, AGG), MBS, denominator=denominator(keep, AGG)
    )
    weights = _per_expert({k: v.detach().clone() for k, v in hf.hf_weights()}, "qwen3_moe")
    return dict(plain=plain, replayed=sc, train=(metrics, weights))


@pytest.fixture(scope="module")
def references(folders):
    return {n: _hf_reference(f, n) for n, f in folders.items()}


def _rank(rank, folder, kw, dp_rows, layers, ref_lp):
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    batch, adv, noise, keep = tiny_batch()
    cfg = MegatronBackendConfig(model=folder, device="cpu", moe_record_routing=True, **OPT, **kw)
    pol = MegatronBackend(cfg)
    rows = torch.tensor(dp_rows[ps.get_data_parallel_rank()], dtype=torch.long)
    local = batch.select(rows)
    replay = dataclasses.replace(local, routed_experts=_routing(layers)[rows])
    plain = pol.score(local, with_entropy=False, micro_batch_size=MBS)
    sc = pol.score(replay, with_entropy=True, micro_batch_size=MBS)
    metrics = pol.train_step(
        replay,
        grpo_loss_fn(local, ref_lp[rows] + noise[rows], adv[rows], keep[rows], AGG),
        MBS,
        denominator=denominator(keep, AGG),
    )
    return {
        "rows": rows,
        "plain": plain.logprobs,
        "logprobs": sc.logprobs,
        "entropy": sc.entropy,
        "own": sc.routed_experts,
        "train": (metrics, dict(pol.hf_weights())),
    }


EP2 = dict(expert_model_parallel_size=2)
LAYOUTS = {
    # name: (world, options, rows per DP rank, model layers)
    "ep1": (1, {}, [list(range(B))], 2),
    "ep2": (2, EP2, HALVES, 2),
    "tp2ep2_sp": (
        4,
        {**EP2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
        HALVES,
        2,
    ),
    "cp2ep2": (2, {**EP2, "context_parallel_size": 2}, [list(range(B))], 2),
    # full activation recomputation: the backward's recomputed forward replays the same
    # routing (each layer's target kept, first in first out)
    "ep2_recompute": (2, {**EP2, "gradient_checkpointing": True}, HALVES, 2),
    "pp2vpp2ep2": (
        4,
        {**EP2, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        HALVES,
        4,
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_replays_and_records_the_routing_as_the_hf_backend(layout, folders, references):
    world, kw, dp_rows, layers = LAYOUTS[layout]
    ref = references[layers]
    results = run_ranks(
        _rank,
        world,
        folders[layers],
        kw,
        dp_rows,
        layers,
        ref["replayed"].logprobs,
        megatron=False,
        timeout=WAIT_S,
    )
    ref_metrics, ref_weights = ref["train"]
    for res in results:
        rows = res["rows"]
        batch = tiny_batch()[0].select(rows)
        resp, attn = batch.response_mask, batch.attention_mask
        # (the HF backend scores response tokens only)
        for key in ("logprobs", "entropy"):
            want = getattr(ref["replayed"], key)[rows]
            err = (res[key][resp] - want[resp]).abs().max()
            assert err <= 1e-4, (layout, key, float(err))
        assert not torch.allclose(res["logprobs"][resp], res["plain"][resp], atol=1e-3)
        err = (res["plain"][resp] - ref["plain"].logprobs[rows][resp]).abs().max()
        assert err <= 1e-4, (layout, "plain", float(err))
        own, hf_own = res["own"], ref["replayed"].routed_experts[rows]
        assert own.shape == hf_own.shape == (len(rows), batch.input_ids.shape[1], layers, TOPK)
        assert bool((own[attn] >= 0).all()) and bool((own[~attn] == NO_EXPERT).all())
        assert not bool(expert_sets_differ(own[attn], hf_own[attn]).any()), layout
        metrics, weights = res["train"]
        assert metrics["skipped"] == 0.0
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
        for name in ref_weights:
            torch.testing.assert_close(
                weights[name], ref_weights[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}"
            )


def _rank_refusals(rank, folder):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    batch = tiny_batch()[0]
    routing = _routing(LAYERS)
    pol = MegatronBackend(
        MegatronBackendConfig(model=folder, device="cpu", use_reference=True, **OPT)
    )
    out = {"records": pol.records_routing}  # auto: only once its own sampler generates
    out["none"] = pol.score(batch, with_entropy=False, micro_batch_size=MBS).routed_experts
    errors = []
    for bad, kwargs in (
        (routing[:, :, :1], {}),  # one layer of two
        (routing, {"reference": True}),
    ):
        try:
            pol.score(dataclasses.replace(batch, routed_experts=bad), with_entropy=False, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.distributed
def test_a_routing_of_the_wrong_shape_or_for_the_reference_is_refused(folders):
    (out,) = run_ranks(_rank_refusals, 1, folders[2], megatron=False, timeout=WAIT_S)
    assert out["records"] is False and out["none"] is None
    assert len(out["errors"]) == 2
    assert "is not [6, 12, 2, 2]" in out["errors"][0]
    assert "reference model routes by itself" in out["errors"][1]
