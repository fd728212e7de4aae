"""``MegatronBackend`` (model.backend=megatron) against plain transformers and the HF
backend, on gloo ranks.

Tiny HF folders (``_tiny_hf.py``): a Llama with GQA (4 heads / 2 kv heads, untied), a
Qwen2 (q/k/v bias, tied) and a Qwen3 (q/k norms, untied; at TP1, TP2 x PP2 with and without
sequence parallelism and with Megatron's distributed optimizer: the q/k norms' gradient is
a per-TP-rank partial sum), vocabulary 300 padded to 384 / 512 by the layout. Checked:

- scores: log-probs and entropy at TP1/PP1, TP2/PP1, TP1/PP2, TP2/PP2 equal a plain
  transformers forward with ``core.entropy`` (max abs error <= 1e-4), identical on every
  rank of a model-parallel group;
- one ``train_step`` at those layouts and at DP2 gives the HF backend's grad norm (rel
  1e-4) and its updated weights (AdamW, atol 1e-5) for token_mean and
  seq_mean_token_mean with token masks where a micro-batch keeps no token;
- rollouts: the Megatron backend's engine samples what the HF backend samples;
- export: a freshly loaded model exports the input tensors bit for bit;
- checkpoints: resume in the same layout is bit-exact; a TP2 x PP2 checkpoint resumes at
  TP1 x PP1 (model + AdamW moments + LR step) to optimizer tolerance.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "distributed"))
from _launch import run_ranks  # noqa: E402
from _grpo_loss import denominator as _denominator, grpo_loss_fn as _loss_fn  # noqa: E402
from _tiny_hf import B, tiny_batch  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed

AGGS = ["token_mean", "seq_mean_token_mean"]
OPT = dict(lr=1e-2, adam_eps=1e-3, weight_decay=0.01, grad_clip=0.5)
MBS = 2
_data = tiny_batch


def _megatron(folder, tp=1, pp=1, **kw):
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    cfg = MegatronBackendConfig(
        model=folder,
        device="cpu",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        **{**OPT, **kw},
    )
    return MegatronBackend(cfg)


def _old_logprobs(scores_lp, noise):
    return scores_lp + noise


# ---------------------------------------------------------------------------- references
def _reference(folder):
    """Plain transformers forward (scores) and the HF backend's train_step (training)."""
    from transformers import AutoModelForCausalLM

    from nemo_d3s.backends.hf.backend import HFBackend
    from nemo_d3s.backends.hf.config import HFBackendConfig
    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    batch, adv, noise, keep = _data()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        ent, lp = entropy_and_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
    attn = batch.attention_mask.float()
    out = {"logprobs": align_to_tokens(lp) * attn, "entropy": align_to_tokens(ent) * attn}
    old_lp = _old_logprobs(out["logprobs"], noise)
    for agg in AGGS:
        hf = HFBackend(HFBackendConfig(model=folder, device="cpu", autocast=None, **OPT))
        metrics = hf.train_step(
            batch, _loss_fn(batch, old_lp, adv, keep, agg), MBS, denominator=_denominator(keep, agg)
        )
        out[agg] = (metrics, {k: v.detach().clone() for k, v in hf.hf_weights()})
    return out


@pytest.fixture(scope="module")
def reference(folders):
    return {arch: _reference(folder) for arch, folder in folders.items()}


# ---------------------------------------------------------------------------- rank bodies
def _rank_layout(rank, folder, tp, pp, dp_rows, ref_lp, kw):
    batch, adv, noise, keep = _data()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pol = _megatron(folder, tp, pp, **kw)
    dp = ps.get_data_parallel_rank()
    rows = torch.tensor(dp_rows[dp], dtype=torch.long)
    local = batch.select(rows)
    sc = pol.score(local, with_entropy=True, micro_batch_size=MBS)
    from nemo_d3s.backends.megatron.optimizer import unwrap_model

    out = {
        "dp": dp,
        "rows": rows,
        "logprobs": sc.logprobs,
        "entropy": sc.entropy,
        "rank": dist.get_rank(),
        "sequence_parallel": unwrap_model(pol.chunks[0]).config.sequence_parallel,
        "pack": pol.pack,
        "fed": sc.stats["fed_tokens"],
        "cp": ps.get_context_parallel_rank(),
        "chunks": len(pol.chunks),
        "position": (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            dp,
        ),
    }
    # old log-probs from the reference's values (the same on every layout)
    old_lp = _old_logprobs(ref_lp, noise)
    for i, agg in enumerate(AGGS):
        if i:
            pol = _megatron(folder, tp, pp, **kw)
        metrics = pol.train_step(
            local,
            _loss_fn(local, old_lp[rows], adv[rows], keep[rows], agg),
            MBS,
            denominator=_denominator(keep, agg),
        )
        out[agg] = (metrics, dict(pol.hf_weights()))
    return out


ALL = [list(range(B))]
LAYOUTS = {
    "tp1pp1": (1, 1, 1, ALL),
    "tp2pp1": (2, 1, 2, ALL),
    "tp1pp2": (1, 2, 2, ALL),
    "tp2pp2": (2, 2, 4, ALL),
    "dp2": (1, 1, 2, [[0, 1, 2, 3], [4, 5]]),
    # Megatron-LM's tp-pp-dp rank order (the 70B recipe's): the backend builds the groups
    "tp1pp2dp2_tp_pp_dp": (1, 2, 4, [[0, 1, 2, 3], [4, 5]], {"use_tp_pp_dp_mapping": True}),
    # sequence parallelism: the backend's own layer spec and layer-norm gradient sum (plain
    # AdamW), and Megatron's DDP + distributed optimizer (its finalize_model_grads sums them)
    "tp2pp2_sp": (2, 2, 4, ALL, {"sequence_parallel": True}),
    "tp2_sp_distributed_optimizer": (
        2,
        1,
        2,
        ALL,
        {"sequence_parallel": True, "distributed_optimizer": True},
    ),
    # interleaved 1F1B: two chunks of one layer per stage (stage 0: layers 0, 2; stage 1:
    # 1, 3), loaded, trained and exported (hf_weights) chunk by chunk; plain AdamW and
    # Megatron's DDP + distributed optimizer (one DDP per chunk, finalize_model_grads)
    "pp2vpp2": (1, 2, 2, ALL, {"virtual_pipeline_model_parallel_size": 2}),
    "pp2vpp2_distributed_optimizer": (
        1,
        2,
        2,
        ALL,
        {"virtual_pipeline_model_parallel_size": 2, "distributed_optimizer": True},
    ),
}


QWEN3_LAYOUTS = ["tp1pp1", "tp2pp2", "tp2pp2_sp", "tp2_sp_distributed_optimizer"]
# packed (THD) rows, micro_batch_size 2: packs of up to 2 x the longest row, attention within
# each row (local_attention.py), one width per call at PP > 1; one model family each
PACKED = {
    ("llama", "pp2vpp2_packed_distributed_optimizer"): (
        1,
        2,
        2,
        ALL,
        {"virtual_pipeline_model_parallel_size": 2, "distributed_optimizer": True},
    ),
    ("qwen2", "dp2_packed"): (1, 1, 2, [[0, 1, 2, 3], [4, 5]], {}),
    ("qwen3", "tp2pp2_sp_packed"): (2, 2, 4, ALL, {"sequence_parallel": True}),
}
# context parallelism 2: rows (widths a multiple of 4) or packs, each CP rank holding 2 of 4
# chunks of every sequence; the engines are the policy's own (one per CP rank's TP x PP group)
CP = {
    ("llama", "cp2"): (1, 1, 2, ALL, {}),
    ("qwen2", "cp2dp2_packed_distributed_optimizer"): (
        1,
        1,
        4,
        [[0, 1, 2, 3], [4, 5]],
        {"pack_sequences": True, "distributed_optimizer": True},
    ),
    ("qwen3", "tp2cp2_sp"): (2, 1, 4, ALL, {"sequence_parallel": True}),
}


@pytest.mark.parametrize(
    "arch,layout",
    # qwen2 repeats llama's layouts with a qkv bias and tied embeddings: two layouts every
    # run, the other eight in the slow tier (CI's budget, docs/ci.md)
    [("llama", lay) for lay in LAYOUTS]
    + [
        (
            ("qwen2", lay)
            if lay in ("tp1pp1", "tp2pp2")
            else pytest.param("qwen2", lay, marks=pytest.mark.slow)
        )
        for lay in LAYOUTS
    ]
    + [("qwen3", lay) for lay in QWEN3_LAYOUTS]
    + list(PACKED)
    + list(CP),
)
def test_layout_matches_transformers_and_the_hf_backend(arch, layout, folders, reference):
    from nemo_d3s.backends.megatron.parallel import global_rank_of, rank_order

    packed = PACKED.get((arch, layout))
    if packed is not None:
        packed[-1]["pack_sequences"] = True
    if (arch, layout) in CP:
        packed = CP[arch, layout]
        packed[-1]["context_parallel_size"] = 2
    tp, pp, world, dp_rows, *kw = packed or LAYOUTS[layout]
    kw = kw[0] if kw else {}
    cp = kw.get("context_parallel_size", 1)
    ref = reference[arch]
    # With options the backend builds Megatron's groups itself; else the harness does.
    results = run_ranks(
        _rank_layout,
        world,
        folders[arch],
        tp,
        pp,
        dp_rows,
        ref["logprobs"],
        kw,
        tp=tp,
        pp=pp,
        megatron=not kw,
        timeout=WAIT_S,
    )
    order = rank_order(kw.get("use_tp_pp_dp_mapping", False))
    assert (
        [
            global_rank_of(
                *r["position"], tp=tp, pp=pp, dp=len(dp_rows), order=order, cp_rank=r["cp"], cp=cp
            )
            for r in results
        ]
        == [r["rank"] for r in results]
        == list(range(world))
    )
    first = {}
    for res in results:
        assert res["sequence_parallel"] == kw.get("sequence_parallel", False)
        assert res["pack"] == kw.get("pack_sequences", False)
        assert res["fed"] % 128 == 0  # every width a multiple of model.params.width_quantum
        assert res["chunks"] == kw.get("virtual_pipeline_model_parallel_size", 1)
        f = first.setdefault(res["dp"], res)
        assert torch.equal(res["logprobs"], f["logprobs"]) and torch.equal(
            res["entropy"], f["entropy"]
        )
        rows = res["rows"]
        for key in ("logprobs", "entropy"):
            err = (res[key] - ref[key][rows]).abs().max()
            assert err <= 1e-4, (layout, key, float(err))
        for agg in AGGS:
            metrics, weights = res[agg]
            ref_metrics, ref_weights = ref[agg]
            assert metrics["skipped"] == 0.0
            assert metrics["grad_norm"] > OPT["grad_clip"]  # clipping is active
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4), (
                layout,
                agg,
            )
            names = set(ref_weights) - ({"lm_head.weight"} if arch == "qwen2" else set())
            if arch == "qwen3":
                assert any(n.endswith("self_attn.q_norm.weight") for n in names)
            assert set(weights) == names
            for name in names:
                torch.testing.assert_close(
                    weights[name],
                    ref_weights[name],
                    rtol=0,
                    atol=1e-5,
                    msg=lambda m: f"{layout} {agg} {name}: {m}",
                )
    # the DP ranks' loss sums add up to the one-process sum
    for agg in AGGS:
        total = sum(first[d][agg][0]["loss_sum"] for d in first)
        assert total == pytest.approx(ref[agg][0]["loss_sum"], rel=1e-4, abs=1e-6)


# ---------------------------------------------------------------------------- rollouts, export
def test_rollouts_and_export_match_the_hf_backend(folders, tmp_path):
    from safetensors.torch import load_file

    from nemo_d3s.backends.base import GenerationConfig
    from nemo_d3s.backends.hf.backend import HFBackend
    from nemo_d3s.backends.hf.config import HFBackendConfig

    # a generation config listing a second EOS id: every engine must stop there, as the HF
    # backend's does; the Megatron backend's own stop set (what a vLLM engine is handed) said
    # only the tokenizer's EOS until a replica was built
    folder = str(tmp_path / "qwen2")
    shutil.copytree(folders["qwen2"], folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [258, 101]}, f)
    gen = GenerationConfig(max_new_tokens=8)
    hf = HFBackend(HFBackendConfig(model=folder, device="cpu"))
    assert 101 in hf.eos_ids
    want = hf.rollout_engine.generate(["hi there", "abc"], 3, gen, [1, 2])
    got = run_ranks(
        _rank_rollouts_export, 2, folder, str(tmp_path / "export"), tp=1, pp=2, timeout=WAIT_S
    )
    for res in got:  # both pipeline stages hold the same rollouts
        assert res["eos_ids"] == hf.eos_ids
        assert torch.equal(res["input_ids"], want.batch.input_ids)
        assert res["response_texts"] == want.response_texts
    src = load_file(os.path.join(folder, "model.safetensors"))
    out = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(out) == sorted(src)
    for k in src:
        assert torch.equal(out[k], src[k]), k  # bit for bit, padding removed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    AutoTokenizer.from_pretrained(str(tmp_path / "export"))


def _rank_rollouts_export(rank, folder, export):
    from nemo_d3s.backends.base import GenerationConfig

    pol = _megatron(folder, 1, 2)
    eos_ids = list(pol.eos_ids)  # before any engine is built
    r = pol.rollout_engine.generate(
        ["hi there", "abc"], 3, GenerationConfig(max_new_tokens=8), [1, 2]
    )
    pol.save_pretrained(export)
    return {"input_ids": r.batch.input_ids, "response_texts": r.response_texts, "eos_ids": eos_ids}


def test_an_interleaved_pipelines_refit_gives_the_engine_the_trained_weights(folders):
    """Issue 32: the refit of a virtual pipeline (two chunks per stage) into the rollout
    engine was only checked by the slow torchrun test. Two ranks at PP 2 x VPP 2: after a
    step, the engine's replica holds exactly the weights the policy exports (every chunk's
    layers, under their global numbers), and they differ from the start."""
    from safetensors.torch import load_file

    folder = folders["llama"]
    start = load_file(os.path.join(folder, "model.safetensors"))
    results = run_ranks(_rank_vpp_refit, 2, folder, megatron=False, timeout=WAIT_S)
    replica, exported = results[0]
    assert sorted(replica) == sorted(exported) and len(replica) >= len(start)
    for k in exported:
        assert torch.equal(replica[k], exported[k]), k
    assert any(not torch.equal(exported[k], start[k]) for k in start if k in exported)


def _rank_vpp_refit(rank, folder):
    pol = _megatron(folder, 1, 2, virtual_pipeline_model_parallel_size=2)
    _steps(pol, 1)
    pol.rollout_engine.sync_weights(pol)
    exported = dict(pol.hf_weights())  # collective: both stages
    inner = getattr(pol.rollout_engine, "inner", None)
    if inner is None:
        return None
    named = dict(inner.replica.model.named_parameters(remove_duplicate=False))
    replica = {k: v.detach().clone() for k, v in named.items() if k in exported}
    return replica, exported


# ---------------------------------------------------------------------------- checkpoints
def _steps(pol, n):
    batch, adv, noise, keep = _data()
    for _ in range(n):
        lp = pol.score(batch, with_entropy=False, micro_batch_size=MBS).logprobs
        pol.train_step(
            batch,
            _loss_fn(batch, lp + noise, adv, keep, "token_mean"),
            MBS,
            denominator=_denominator(keep, "token_mean"),
        )


def _rank_save(rank, folder, ckpt, tp, pp, kw=None):
    pol = _megatron(
        folder, tp, pp, scheduler="linear", total_steps=10, warmup_steps=1, **(kw or {})
    )
    _steps(pol, 1)
    pol.save_checkpoint(ckpt)
    _steps(pol, 1)
    return dict(pol.hf_weights()), pol.optimizer.param_groups[0]["lr"]


def _rank_resume(rank, folder, ckpt, tp, pp, kw=None):
    pol = _megatron(
        folder, tp, pp, scheduler="linear", total_steps=10, warmup_steps=1, **(kw or {})
    )
    pol.load_checkpoint(ckpt)
    _steps(pol, 1)
    return dict(pol.hf_weights()), pol.optimizer.param_groups[0]["lr"]


def test_checkpoint_resumes_bit_exactly_and_in_another_layout(folders, tmp_path):
    folder, ckpt = folders["llama"], str(tmp_path / "ckpt")
    saved = run_ranks(_rank_save, 4, folder, ckpt, 2, 2, tp=2, pp=2, timeout=WAIT_S)
    want, lr = saved[0]
    assert sorted(os.listdir(os.path.join(ckpt, "megatron"))) == [
        "layout.json",
        "tp00_pp00.safetensors",
        "tp00_pp01.safetensors",
        "tp01_pp00.safetensors",
        "tp01_pp01.safetensors",
    ]
    same = run_ranks(_rank_resume, 4, folder, ckpt, 2, 2, tp=2, pp=2, timeout=WAIT_S)
    for got, got_lr in same:
        assert got_lr == lr
        for k in want:
            assert torch.equal(got[k], want[k]), k
    ((other, other_lr),) = run_ranks(
        _rank_resume, 1, folder, ckpt, 1, 1, tp=1, pp=1, timeout=WAIT_S
    )
    assert other_lr == lr
    fresh, _ = run_ranks(_rank_fresh_two_steps, 1, folder, tp=1, pp=1, timeout=WAIT_S)[0]
    moved = 0
    for k in want:
        torch.testing.assert_close(other[k], want[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
        moved += int(not torch.equal(want[k], fresh[k]))
    assert moved  # the comparison would catch a reset optimizer: a fresh second step differs


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
def test_context_parallel_checkpoint_resumes_bit_exactly_and_at_cp1(folders, tmp_path):
    """A CP2 x DP2 checkpoint with Megatron's distributed optimizer (its state sharded over
    DP x CP, gathered to the CP rank 0 writer) is a TP1 x PP1 one: it resumes bit-exactly at
    CP2 x DP2 and, at CP 1 on one process with plain AdamW, to optimizer tolerance."""
    folder, ckpt = folders["llama"], str(tmp_path / "ckpt")
    kw = {"context_parallel_size": 2, "distributed_optimizer": True, "pack_sequences": True}
    saved = run_ranks(_rank_save, 4, folder, ckpt, 1, 1, kw, megatron=False, timeout=WAIT_S)
    want, lr = saved[0]
    assert sorted(os.listdir(os.path.join(ckpt, "megatron"))) == [
        "layout.json",
        "tp00_pp00.safetensors",
    ]
    for got, got_lr in run_ranks(
        _rank_resume, 4, folder, ckpt, 1, 1, kw, megatron=False, timeout=WAIT_S
    ):
        assert got_lr == lr and all(torch.equal(got[k], want[k]) for k in want)
    got, got_lr = run_ranks(_rank_resume, 1, folder, ckpt, 1, 1, tp=1, pp=1, timeout=WAIT_S)[0]
    assert got_lr == lr
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
def test_virtual_pipeline_checkpoint_resumes_bit_exactly_and_in_another_layout(folders, tmp_path):
    """A PP2 x VPP2 checkpoint is a TP1 x PP4 one (a chunk saved as its virtual stage): it
    resumes bit-exactly at PP2 x VPP2 and, resharded, at TP1 x PP1 and at PP2 without
    chunks, model + AdamW moments + LR step."""
    folder, ckpt = folders["llama"], str(tmp_path / "ckpt")
    vpp = {"virtual_pipeline_model_parallel_size": 2}
    want, lr = run_ranks(_rank_save, 2, folder, ckpt, 1, 2, vpp, megatron=False, timeout=WAIT_S)[0]
    assert sorted(os.listdir(os.path.join(ckpt, "megatron"))) == [
        "layout.json",
        *(f"tp00_pp0{s}.safetensors" for s in range(4)),
    ]
    for got, got_lr in run_ranks(
        _rank_resume, 2, folder, ckpt, 1, 2, vpp, megatron=False, timeout=WAIT_S
    ):
        assert got_lr == lr and all(torch.equal(got[k], want[k]) for k in want)
    for (tp, pp), world in (((1, 1), 1), ((1, 2), 2)):
        got, got_lr = run_ranks(
            _rank_resume, world, folder, ckpt, tp, pp, tp=tp, pp=pp, timeout=WAIT_S
        )[0]
        assert got_lr == lr
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}"
            )


def test_virtual_pipeline_checkpoint_converts_to_the_exported_weights(folders, tmp_path):
    """``nemo-d3s-convert megatron-to-hf`` on a PP2 x VPP2 training checkpoint writes the
    weights the backend exports (hf_weights over its chunks), bit for bit."""
    from safetensors.torch import load_file

    from nemo_d3s.convert import megatron_to_hf
    from nemo_d3s.files import write_checksums

    folder, ckpt = folders["qwen2"], str(tmp_path / "ckpt")
    exported = run_ranks(_rank_save_export, 2, folder, ckpt, megatron=False, timeout=WAIT_S)[0]
    write_checksums(ckpt)  # as the trainer does after the backend's save (required to read it)
    out = megatron_to_hf(ckpt, tmp_path / "hf", hf_config=folder, progress=False)
    got = {
        k: v
        for f in os.listdir(out)
        if f.endswith(".safetensors")
        for k, v in load_file(str(out / f)).items()
    }
    assert sorted(got) == sorted(exported)
    for k in exported:
        assert torch.equal(got[k], exported[k]), k


def _rank_save_export(rank, folder, ckpt):
    pol = _megatron(folder, 1, 2, virtual_pipeline_model_parallel_size=2)
    _steps(pol, 1)
    pol.save_checkpoint(ckpt)
    return dict(pol.hf_weights())


def _rank_fresh_two_steps(rank, folder):
    # step 2 with the optimizer state and LR of a fresh model instead of the checkpoint's
    pol = _megatron(folder, 1, 1, scheduler="linear", total_steps=10, warmup_steps=1)
    _steps(pol, 1)
    pol2 = _megatron(folder, 1, 1, scheduler="linear", total_steps=10, warmup_steps=1)
    with torch.no_grad():
        for p2, p in zip(pol2.model.parameters(), pol.model.parameters()):
            p2.copy_(p)
    _steps(pol2, 1)
    return dict(pol2.hf_weights()), 0.0


def test_checkpoint_of_another_model_is_refused_before_loading(folders, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_rank_save_only, 1, folders["llama"], ckpt, tp=1, pp=1, timeout=WAIT_S)
    err = run_ranks(_rank_load_other, 1, folders["qwen2"], ckpt, tp=1, pp=1, timeout=WAIT_S)[0]
    assert "checkpoint of another model" in err


def _rank_save_only(rank, folder, ckpt):
    _megatron(folder).save_checkpoint(ckpt)


def _rank_load_other(rank, folder, ckpt):
    from nemo_d3s.config import ConfigError

    pol = _megatron(folder)
    before = {k: v.clone() for k, v in pol.model.state_dict().items() if torch.is_tensor(v)}
    try:
        pol.load_checkpoint(ckpt)
    except ConfigError as e:
        after = pol.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        return str(e)
    return "loaded"


# ---------------------------------------------------------------------------- bad input
def test_bad_folders_fail_at_start_up(folders, tmp_path, monkeypatch):
    import shutil

    from nemo_d3s.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "1")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(folders["llama"], no_weights)
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(ConfigError, match="no model.safetensors"):
        _megatron(str(no_weights))
    with pytest.raises(ConfigError, match="world size 1 is not divisible"):
        _megatron(folders["llama"], tp=2)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size"):
        _megatron(folders["llama"], virtual_pipeline_model_parallel_size=2)
    other = tmp_path / "other"
    shutil.copytree(folders["llama"], other)
    cfg = (
        (other / "config.json")
        .read_text()
        .replace('"intermediate_size": 48', '"intermediate_size": 64')
    )
    (other / "config.json").write_text(cfg)
    with pytest.raises(ConfigError, match="has shape .* another model"):
        _megatron(str(other))


def test_a_bf16_model_on_the_local_spec_is_bf16_throughout_and_exports(folders, tmp_path):
    """megatron-core's local spec builds its norms in fp32 whatever params_dtype says; the
    backend casts them as Megatron-LM's Float16Module does. Seen on an H200 (the first CUDA
    run): a bf16 run trained, then its HF export refused the fp32 norm weights. The CPU twin:
    one rank, bf16, local spec; every parameter bf16, the export bit-equal to the source
    weights in bf16 (norms included)."""
    from safetensors.torch import load_file

    folder = folders["qwen3"]  # q/k norms too
    export = tmp_path / "export"
    (dtypes,) = run_ranks(_rank_bf16_export, 1, folder, str(export), timeout=WAIT_S)
    assert dtypes == {"torch.bfloat16"}
    src = load_file(os.path.join(folder, "model.safetensors"))
    out = load_file(str(export / "model.safetensors"))
    assert any("norm" in k for k in out) and sorted(out) == sorted(src)
    for k in src:
        assert out[k].dtype == torch.bfloat16, k
        assert torch.equal(out[k], src[k].bfloat16()), k


def _rank_bf16_export(rank, folder, export):
    pol = _megatron(folder, 1, 1, dtype="bfloat16")
    dtypes = {str(p.dtype) for p in pol.model.parameters()}
    pol.save_pretrained(export)
    return dtypes
