"""Mixture-of-experts models on the Megatron backend (megatron-core's MoELayer with
SequentialMLP experts on gloo ranks) against transformers and the HF backend.

Tiny random Qwen3-MoE (top-2 of 4 experts, with and without renormalised top-k probabilities),
Mixtral and Qwen2-MoE (a gated shared expert) folders (``_tiny_hf.py``). At EP 1, EP 2 (both
dispatchers), TP 2 x EP 2 (sequence parallel) and PP 2 x EP 2, each with DP 2 where the world
allows: log-probs and entropies equal a transformers forward (max abs error <= 1e-4, the dense
tests' tolerance); one train step gives the HF backend's gradient norm (rel 1e-4) and updated
weights (atol 1e-5), so the EP 2 gradients equal the EP 1 ones through the same reference;
``hf_weights`` of a fresh model gives back the input tensors bit for bit."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "distributed"))
from _launch import run_ranks  # noqa: E402
from _grpo_loss import denominator, grpo_loss_fn  # noqa: E402
from _tiny_hf import B, make_tiny_hf, tiny_batch  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

OPT = dict(lr=1e-2, adam_eps=1e-3, weight_decay=0.01, grad_clip=0.5)
MBS = 2
AGG = "token_mean"
HALVES = [[0, 1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {
        a: str(make_tiny_hf(root / a, a, layers=2))
        for a in ("qwen3_moe", "qwen3_moe_norm", "mixtral", "qwen2_moe")
    } | {"qwen3_moe_4l": str(make_tiny_hf(root / "q4", "qwen3_moe", layers=4))}


def _per_expert(state, arch):
    """transformers 5's in-memory MoE tensors (``mlp.gate.weight``, fused
    ``mlp.experts.gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F]) under the names and
    shapes its checkpoints hold (one tensor per expert; Mixtral's ``block_sparse_moe`` and
    w1 / w3 / w2)."""
    block, (gate, up, down) = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if arch == "mixtral"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    out = {}
    for k, v in state.items():
        layer, _, leaf = k.partition(".mlp.")
        if not leaf or leaf.startswith("shared_expert"):  # Qwen2-MoE's shared expert: unfused
            out[k] = v
        elif leaf == "gate.weight":
            out[f"{layer}.{block}.gate.weight"] = v
        elif leaf == "experts.gate_up_proj":
            for e, w in enumerate(v):
                g, u = w.chunk(2)
                out[f"{layer}.{block}.experts.{e}.{gate}.weight"] = g
                out[f"{layer}.{block}.experts.{e}.{up}.weight"] = u
        elif leaf == "experts.down_proj":
            for e, w in enumerate(v):
                out[f"{layer}.{block}.experts.{e}.{down}.weight"] = w
        else:
            raise KeyError(k)
    return out


def _reference(folder, arch):
    """transformers' log-probs / entropies and the HF backend's train step."""
    from transformers import AutoModelForCausalLM

    from nemo_d3s.backends.hf.backend import HFBackend
    from nemo_d3s.backends.hf.config import HFBackendConfig
    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    batch, adv, noise, keep = tiny_batch()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        ent, lp = entropy_and_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
    attn = batch.attention_mask.float()
    out = {"logprobs": align_to_tokens(lp) * attn, "entropy": align_to_tokens(ent) * attn}
    hf = HFBackend(HFBackendConfig(model=folder, device="cpu", autocast=None, **OPT))
    old_lp = out["logprobs"] + noise
    metrics = hf.train_step(
        batch, grpo_loss_fn(batch, old_lp, adv, keep, AGG), MBS, denominator=denominator(keep, AGG)
    )
    state = {k: v.detach().clone() for k, v in hf.hf_weights()}
    out["train"] = (metrics, _per_expert(state, arch))
    return out


@pytest.fixture(scope="module")
def moe_reference(moe_folders):
    return {a: _reference(f, a) for a, f in moe_folders.items()}


def _rank_layout(rank, folder, kw, dp_rows, ref_lp, tokens=0):
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig
    from nemo_d3s.backends.megatron.optimizer import is_megatron_optimizer

    batch, adv, noise, keep = tiny_batch()
    pol = MegatronBackend(MegatronBackendConfig(model=folder, device="cpu", **{**OPT, **kw}))
    dp = ps.get_data_parallel_rank()
    rows = torch.tensor(dp_rows[dp], dtype=torch.long)
    local = batch.select(rows)
    sc = pol.score(local, with_entropy=True, micro_batch_size=MBS, micro_batch_tokens=tokens)
    old_lp = ref_lp + noise
    metrics = pol.train_step(
        local,
        grpo_loss_fn(local, old_lp[rows], adv[rows], keep[rows], AGG),
        MBS,
        denominator=denominator(keep, AGG),
        micro_batch_tokens=tokens,
    )
    return {
        "rows": rows,
        "logprobs": sc.logprobs,
        "entropy": sc.entropy,
        "ep": (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()),
        "local_experts": sum(
            1
            for n, _ in pol.chunks[0].named_parameters()
            if ".mlp.experts." in n and n.endswith("linear_fc1.weight")
        ),
        "train": (metrics, dict(pol.hf_weights())),
        "megatron_optimizer": is_megatron_optimizer(pol.optimizer),
    }


EP2 = dict(expert_model_parallel_size=2)
LAYOUTS = {
    # name: (world, backend options, rows per DP rank)
    "ep1": (1, {}, [list(range(B))]),
    "ep2_alltoall": (2, EP2, HALVES),
    "ep2_allgather": (2, {**EP2, "moe_token_dispatcher_type": "allgather"}, HALVES),
    "tp2ep2_sp": (
        4,
        {**EP2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
        HALVES,
    ),
    "pp2ep2": (4, {**EP2, "pipeline_model_parallel_size": 2}, HALVES),
    # EP over the two context-parallel ranks of one copy (DP 1): each holds half of every
    # row's tokens and sends them to their experts' rank
    "cp2ep2": (2, {**EP2, "context_parallel_size": 2}, [list(range(B))]),
    # EP carved out of DP x CP: two expert-data-parallel ranks per expert shard
    "dp2cp2ep2": (4, {**EP2, "context_parallel_size": 2}, HALVES),
    # an interleaved pipeline (2 stages x 2 chunks of the 4-layer model) with experts
    "pp2vpp2ep2": (
        4,
        {**EP2, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        HALVES,
    ),
}
# Megatron's distributed optimizer: dense state sharded over DP, expert state over expert DP
# (EP 2 in a world of 4: two expert-DP ranks per expert shard)
DOPT = dict(distributed_optimizer=True)
LAYOUTS.update(
    {
        "ep2_dopt": (2, {**EP2, **DOPT}, HALVES),
        "dp4ep2_dopt": (4, {**EP2, **DOPT}, [[0, 1], [2, 3], [4], [5]]),
    }
)
# token budgets (trainer.micro_batch_tokens): 16 tokens a micro-batch, so the two DP ranks'
# plans differ in count and shape (4 rows against 2) and the MoE plans are aligned
TOKENS = {"ep2_tokens": "ep2_alltoall", "ep2_tokens_allgather": "ep2_allgather"}
LAYOUTS.update({name: LAYOUTS[base] for name, base in TOKENS.items()})
FOUR_LAYERS = {"pp2vpp2ep2"}
CASES = [("qwen3_moe_4l" if lay in FOUR_LAYERS else "qwen3_moe", lay) for lay in LAYOUTS] + [
    ("qwen3_moe_norm", "ep2_alltoall"),
    ("mixtral", "ep1"),
    ("mixtral", "ep2_alltoall"),
    ("mixtral", "tp2ep2_sp"),
    # Qwen2-MoE: a shared expert (split over TP like the dense MLP) behind a sigmoid gate
    ("qwen2_moe", "ep1"),
    ("qwen2_moe", "ep2_alltoall"),
    ("qwen2_moe", "tp2ep2_sp"),
]


# Mixtral at TP 2 x EP 2 + SP repeats Qwen3-MoE's: the slow tier (CI's budget, docs/ci.md)
@pytest.mark.parametrize(
    "arch,layout",
    [
        pytest.param(a, lay, marks=pytest.mark.slow)
        if (a, lay) == ("mixtral", "tp2ep2_sp")
        else (a, lay)
        for a, lay in CASES
    ],
    ids=[f"{a}-{lay}" for a, lay in CASES],
)
def test_moe_layout_matches_transformers_and_the_hf_backend(
    arch, layout, moe_folders, moe_reference
):
    world, kw, dp_rows = LAYOUTS[layout]
    ref = moe_reference[arch]
    results = run_ranks(
        _rank_layout,
        world,
        moe_folders[arch],
        kw,
        dp_rows,
        ref["logprobs"],
        16 if layout in TOKENS else 0,
        megatron=False,
        timeout=WAIT_S,
    )
    ep = kw.get("expert_model_parallel_size", 1)
    ref_metrics, ref_weights = ref["train"]
    for res in results:
        # layers of the first model chunk: the model's over PP x VPP
        chunks = kw.get("pipeline_model_parallel_size", 1) * kw.get(
            "virtual_pipeline_model_parallel_size", 1
        )
        layers = (4 if arch == "qwen3_moe_4l" else 2) // chunks
        assert res["ep"][0] == ep and res["local_experts"] == layers * 4 // ep
        assert res["megatron_optimizer"] == kw.get("distributed_optimizer", False)
        rows = res["rows"]
        for key in ("logprobs", "entropy"):
            err = (res[key] - ref[key][rows]).abs().max()
            assert err <= 1e-4, (layout, key, float(err))
        metrics, weights = res["train"]
        assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > OPT["grad_clip"]
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
        assert set(weights) == set(ref_weights)
        assert any(".experts.3." in n for n in weights)
        for name in ref_weights:
            torch.testing.assert_close(
                weights[name], ref_weights[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}"
            )
    assert sorted(r["ep"][1] for r in results) == sorted(list(range(ep)) * (world // ep))


# ---------------------------------------------------------------------------- checkpoints
def _steps(pol, n):
    batch, adv, noise, keep = tiny_batch()
    for _ in range(n):
        lp = pol.score(batch, with_entropy=False, micro_batch_size=MBS).logprobs
        pol.train_step(
            batch,
            grpo_loss_fn(batch, lp + noise, adv, keep, AGG),
            MBS,
            denominator=denominator(keep, AGG),
        )


def _policy(folder, ep, cp=1, dopt=False):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    cfg = MegatronBackendConfig(
        model=folder,
        device="cpu",
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        distributed_optimizer=dopt,
        scheduler="linear",
        total_steps=10,
        warmup_steps=1,
        **OPT,
    )
    return MegatronBackend(cfg)


def _rank_save(rank, folder, ckpt, ep, cp=1, dopt=False):
    pol = _policy(folder, ep, cp, dopt)
    _steps(pol, 1)
    pol.save_checkpoint(ckpt)
    saved = dict(pol.hf_weights())
    _steps(pol, 1)
    return saved, dict(pol.hf_weights())


def _rank_resume(rank, folder, ckpt, ep, cp=1, dopt=False):
    pol = _policy(folder, ep, cp, dopt)
    pol.load_checkpoint(ckpt)
    loaded = dict(pol.hf_weights())
    _steps(pol, 1)
    return loaded, dict(pol.hf_weights())


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
def test_ep2_checkpoint_resumes_bit_exactly_at_ep1_and_ep4(moe_folders, tmp_path):
    """Saved at EP 2 (expert files ep00 / ep01): the model loads bit for bit at EP 2, EP 1
    and EP 4, and the next step (Adam moments resharded with the experts) matches the
    uninterrupted EP 2 run (bit for bit at EP 2, 1e-5 elsewhere)."""
    folder, ckpt = moe_folders["qwen3_moe"], str(tmp_path / "ckpt")
    (saved, after), _ = run_ranks(_rank_save, 2, folder, ckpt, 2, megatron=False, timeout=WAIT_S)
    files = sorted(os.listdir(os.path.join(ckpt, "megatron")))
    assert files == [
        "ep00_etp00_pp00.safetensors",
        "ep01_etp00_pp00.safetensors",
        "layout.json",
        "tp00_pp00.safetensors",
    ]
    for ep in (2, 1, 4):
        results = run_ranks(_rank_resume, ep, folder, ckpt, ep, megatron=False, timeout=WAIT_S)
        for loaded, stepped in results:
            assert sorted(loaded) == sorted(saved)
            assert all(torch.equal(loaded[k], saved[k]) for k in saved), ep
            moved = [k for k in after if not torch.equal(after[k], saved[k])]
            assert any(".experts." in k for k in moved)
            for k in after:
                if ep == 2:
                    assert torch.equal(stepped[k], after[k]), k
                else:
                    torch.testing.assert_close(stepped[k], after[k], rtol=0, atol=1e-5)


@pytest.mark.slow  # a multi-rank equality run: the slow tier (docs/ci.md)
def test_a_cp2_ep2_checkpoint_holds_every_expert_file_and_resumes_bit_exactly(
    moe_folders, tmp_path
):
    """Saved at CP 2 x EP 2 (one model copy over two ranks, its experts split over the CP
    ranks: one expert file each): the model loads bit for bit at EP 1 in one process and at
    CP 2 x EP 2, and the next step matches the uninterrupted run's (bit for bit at CP 2 x EP 2,
    1e-5 in one process)."""
    folder, ckpt = moe_folders["qwen3_moe"], str(tmp_path / "ckpt")
    (saved, after), (saved1, _) = run_ranks(
        _rank_save, 2, folder, ckpt, 2, 2, megatron=False, timeout=WAIT_S
    )
    assert all(torch.equal(saved[k], saved1[k]) for k in saved)  # one copy: the same weights
    assert {"ep00_etp00_pp00.safetensors", "ep01_etp00_pp00.safetensors"} <= set(
        os.listdir(os.path.join(ckpt, "megatron"))
    )
    assert any(".experts." in k and not torch.equal(after[k], saved[k]) for k in after)
    for world, ep, cp in ((1, 1, 1), (2, 2, 2)):
        results = run_ranks(
            _rank_resume, world, folder, ckpt, ep, cp, megatron=False, timeout=WAIT_S
        )
        for loaded, stepped in results:
            assert sorted(loaded) == sorted(saved)
            assert all(torch.equal(loaded[k], saved[k]) for k in saved)
            for k in after:
                if cp == 2:  # the saved layout: bit for bit
                    assert torch.equal(stepped[k], after[k]), k
                else:
                    torch.testing.assert_close(stepped[k], after[k], rtol=0, atol=1e-5)


def test_distributed_optimizer_checkpoint_of_experts_resumes_at_other_layouts(
    moe_folders, tmp_path
):
    """Megatron's distributed optimizer with experts, saved at DP 4 x EP 2 (dense state
    sharded over the four DP ranks, expert state over the two expert-DP ranks of each expert
    shard, each gathered to its file's writer): the model loads bit for bit and the next step
    (Adam moments and step count from the file) matches the uninterrupted run bit for bit at
    the saved layout; at EP 2 in a world of 2 (expert state unsharded) and at EP 1 with the
    plain AdamW, within 1e-5. The expert files hold the moments of every expert."""
    from safetensors import safe_open

    folder, ckpt = moe_folders["qwen3_moe"], str(tmp_path / "ckpt")
    runs = run_ranks(_rank_save, 4, folder, ckpt, 2, 1, True, megatron=False, timeout=WAIT_S)
    saved, after = runs[0]
    root = os.path.join(ckpt, "megatron")
    for e in (0, 1):
        with safe_open(os.path.join(root, f"ep0{e}_etp00_pp00.safetensors"), "pt") as f:
            keys = set(f.keys())
        experts = {k for k in keys if not k.startswith("optim.")}
        assert experts and all(".mlp.experts." in k for k in experts)
        for k in ("exp_avg", "exp_avg_sq"):
            assert {f"optim.{k}.{n}" for n in experts} <= keys
    with safe_open(os.path.join(root, "tp00_pp00.safetensors"), "pt") as f:
        assert not any(".mlp.experts." in k for k in f.keys())
        assert f.get_tensor("optim.exp_avg_sq.decoder.final_layernorm.weight").abs().max() > 0
    for world, ep, dopt in ((4, 2, True), (2, 2, True), (1, 1, False)):
        results = run_ranks(
            _rank_resume, world, folder, ckpt, ep, 1, dopt, megatron=False, timeout=WAIT_S
        )
        for loaded, stepped in results:
            assert sorted(loaded) == sorted(saved)
            assert all(torch.equal(loaded[k], saved[k]) for k in saved), world
            for k in after:
                if world == 4:
                    assert torch.equal(stepped[k], after[k]), k
                else:
                    torch.testing.assert_close(stepped[k], after[k], rtol=0, atol=1e-5)


def _rank_empty(rank, folder):
    """DP rank 1 scores and trains on no rows while rank 0 has six: its MoE layers still
    serve rank 0's dispatches (a rank returning early would leave rank 0 waiting)."""
    batch, adv, noise, keep = tiny_batch()
    pol = _policy(folder, 2)
    rows = torch.arange(B) if rank == 0 else torch.zeros(0, dtype=torch.long)
    local = batch.select(rows)
    sc = pol.score(local, with_entropy=False, micro_batch_size=MBS)
    metrics = pol.train_step(
        local,
        grpo_loss_fn(local, (sc.logprobs + noise[rows]), adv[rows], keep[rows], AGG),
        MBS,
        denominator=denominator(keep, AGG),
    )
    return sc.logprobs, metrics["grad_norm"]


def test_a_rank_without_rows_serves_the_dispatches(moe_folders, moe_reference):
    (lp, norm0), (empty, norm1) = run_ranks(
        _rank_empty, 2, moe_folders["qwen3_moe"], megatron=False, timeout=WAIT_S
    )
    assert empty.shape == (0, lp.shape[1]) and norm0 == norm1 > 0
    assert (lp - moe_reference["qwen3_moe"]["logprobs"]).abs().max() <= 1e-4


def _rank_router_losses(rank, folder, ep, coeff):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    batch, adv, noise, keep = tiny_batch()
    pol = MegatronBackend(
        MegatronBackendConfig(
            model=folder,
            device="cpu",
            expert_model_parallel_size=ep,
            moe_aux_loss_coeff=coeff,
            moe_z_loss_coeff=coeff,
            **OPT,
        )
    )
    rows = torch.arange(B) if ep == 1 else torch.arange(3 * rank, 3 * rank + 3)
    local = batch.select(rows)
    lp = pol.score(local, with_entropy=False, micro_batch_size=1).logprobs
    metrics = pol.train_step(
        local,
        grpo_loss_fn(local, lp + noise[rows], adv[rows], keep[rows], AGG),
        1,
        denominator=denominator(keep, AGG),
    )
    return {k: v for k, v in metrics.items() if k.startswith("moe_")}, dict(pol.hf_weights())


def test_router_losses_are_logged_and_enter_the_gradient_alike_at_ep1_and_ep2(moe_folders):
    """One row per micro-batch, so EP 2's two DP ranks (rows 0-2, 3-5) run the micro-batches
    EP 1 runs and megatron-core's per-micro-batch losses are the same: EP 2's logged losses
    sum over DP to EP 1's, and the update with coefficients 0.1 equals EP 1's (atol 1e-5) and
    differs from the update without them; coefficient 0 logs nothing."""
    folder = moe_folders["qwen3_moe"]
    ((none, plain),) = run_ranks(_rank_router_losses, 1, folder, 1, 0.0, megatron=False)
    ((one, w1),) = run_ranks(_rank_router_losses, 1, folder, 1, 0.1, megatron=False)
    two = run_ranks(_rank_router_losses, 2, folder, 2, 0.1, megatron=False, timeout=WAIT_S)
    assert none == {} and set(one) == {"moe_load_balancing_loss", "moe_z_loss"}
    assert one["moe_load_balancing_loss"] > 0 and one["moe_z_loss"] > 0
    for k in one:
        assert sum(m[k] for m, _ in two) == pytest.approx(one[k], rel=1e-6)
    gate = "model.layers.0.mlp.gate.weight"
    assert (w1[gate] - plain[gate]).abs().max() > 1e-6
    for _, w2 in two:
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5)


def test_experts_refuse_packed_rows_before_start():
    from types import SimpleNamespace

    from nemo_d3s.backends.megatron.moe import check_moe_layout
    from nemo_d3s.errors import ConfigError

    moe = SimpleNamespace(
        num_experts=4, architecture="Qwen3MoeForCausalLM", moe_topk=2, moe_pre_softmax=False
    )
    dense = SimpleNamespace(num_experts=0, architecture="LlamaForCausalLM")
    kw = dict(tp=1, sequence_parallel=False)
    with pytest.raises(ConfigError, match="pack_sequences=false"):
        check_moe_layout(moe, packed=True, **kw)
    check_moe_layout(moe, **kw)  # rows: the tested layout (any CP: the cp2ep2 case above)
    check_moe_layout(dense, packed=True, **kw)  # a dense model packs
