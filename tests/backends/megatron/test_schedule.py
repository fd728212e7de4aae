"""The Megatron backend's score / train_step (``nemo_d3s.backends.megatron.schedule``) at
TP x PP x DP layouts equal one process on the full weights.

A tiny megatron-core ``GPTModel`` (local layer spec: RMSNorm, GQA 4 heads / 2 kv heads,
q/k/v bias, SwiGLU, RoPE; vocabulary 37 padded to 40, tied or untied embeddings) is built on
every rank for its TP/PP position, and every parameter is overwritten with its slice of ONE
set of full weights (drawn per full-model name from a fixed seed; padded vocabulary rows get
random values too, so a leak into the softmax would show). The reference is the same model
at TP1/PP1 in one process: a plain forward of the whole batch, log-probs and entropy from
``core.entropy`` on the first 37 logits, the loss closure of the trainer
(``trainer.update.make_loss_fn``) on all rows divided by the global denominator, torch's
``clip_grad_norm_`` and one optimizer step. Nothing of the code under test runs in it.

Checked per layout: ``score`` log-probs and entropy (max abs error <= 1e-4, identical on
every rank); one ``train_step`` for ``token_mean`` and ``seq_mean_token_mean`` with token
masks where a micro-batch has no kept token: the grad norm (rel 1e-4), the updated full
weights with SGD (lr 1: the step IS the clipped gradient, so every gradient entry is
compared) and with AdamW (the optimizer the backend uses), metrics; at DP2 with unequal
micro-batch counts (4 + 2 rows) and with one DP rank holding no rows at all.
"""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "distributed")
)
from _launch import run_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _grpo_loss import denominator as _denominator, grpo_loss_fn as _loss_fn  # noqa: E402
from _tiny_hf import tiny_batch  # noqa: E402
from _limits import WAIT_S  # noqa: E402

V_REAL, V_PAD = 37, 40
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 48, 4, 2, 4
B, S, MBS = 6, 10, 2
LENGTHS = [10, 7, 9, 4, 8, 10]
PROMPT = [3, 2, 4, 2, 3, 5]
AGGS = ["token_mean", "seq_mean_token_mean"]
GRAD_CLIP = 0.5  # below the gradient norms here, so clipping is active
# SGD with lr 1: the update IS the clipped gradient, compared entry by entry. AdamW's first
# step is about lr g / (|g| + eps): eps 1e-3 keeps it from amplifying the fp32 summation
# noise (~1e-8) of near-zero gradient entries into lr-sized differences.
OPTIMIZERS = {"sgd": dict(lr=1.0), "adamw": dict(lr=1e-2, eps=1e-3, weight_decay=0.01)}
WEIGHT_ATOL = {"sgd": 1e-6, "adamw": 1e-5}


# ---------------------------------------------------------------------------- model + weights
def tiny_gpt(tied: bool, dropout: float = 0.0, sp: bool = False, vp_stage=None):
    """The test model for this rank's TP/PP position, Megatron's own initialisation (needs
    ``apply_cpu_compat`` first); ``sp``: sequence parallelism, with the backend's layer spec
    (``sequence_parallel.local_block_spec``); ``vp_stage``: chunk ``vp_stage`` of Megatron's
    virtual pipeline (its size from parallel_state). Also used by test_cpu_compat.py."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        sequence_parallel=sp,
        virtual_pipeline_model_parallel_size=None if vp_stage is None else _vpp(),
        context_parallel_size=ps.get_context_parallel_world_size(),
    )
    pp, p = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    v, vpp = (0, 1) if vp_stage is None else (vp_stage, _vpp())
    if sp:
        from nemo_d3s.backends.megatron.sequence_parallel import local_block_spec

        spec = local_block_spec(cfg, pp_rank=ps.get_pipeline_model_parallel_rank())
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    from nemo_d3s.backends.megatron.local_attention import with_packed_attention

    return GPTModel(
        config=cfg,
        transformer_layer_spec=with_packed_attention(spec),  # as the backend's build_stage
        vocab_size=V_PAD,
        max_sequence_length=64,
        pre_process=p == 0 and v == 0,
        post_process=p == pp - 1 and v == vpp - 1,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )


def _vpp() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_virtual_pipeline_model_parallel_world_size() or 1


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _build(tied: bool, sp: bool = False, vpp: int = 1):
    """The test model holding its slice of the full weights (a list of ``vpp`` chunks when
    vpp > 1, Megatron's virtual pipeline size set to it)."""
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    if vpp > 1:
        ps.set_virtual_pipeline_model_parallel_world_size(vpp)
        ps.set_virtual_pipeline_model_parallel_rank(0)
        model = [tiny_gpt(tied, sp=sp, vp_stage=v) for v in range(vpp)]
    else:
        model = tiny_gpt(tied, sp=sp)
    _load_full_weights(model, tied)
    return model


def _full_name(name: str, tied: bool, vp_stage=None) -> str:
    """Local parameter name (of chunk ``vp_stage`` of a virtual pipeline) -> its name in the
    TP1/PP1 model: chunk v of stage p holds the (v PP + p)-th run of L / (PP VPP) layers."""
    from megatron.core import parallel_state as ps

    if tied and name == "output_layer.weight":  # the last stage's copy of the embedding
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        pp = ps.get_pipeline_model_parallel_world_size()
        v, vpp = (0, 1) if vp_stage is None else (vp_stage, _vpp())
        per_chunk = LAYERS // (pp * vpp)
        parts[2] = str(int(parts[2]) + (v * pp + ps.get_pipeline_model_parallel_rank()) * per_chunk)
    return ".".join(parts)


def _tp_layout(name: str, p):
    """(partition dim, number of interleaved blocks) of a parameter: the gated fc1 holds
    [gate; up] on every rank, i.e. two blocks each split over TP."""
    if not getattr(p, "tensor_model_parallel", False):
        return None, 1
    return p.partition_dim, 2 if name.endswith("mlp.linear_fc1.weight") else 1


def _full_tensor(full_name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(full_name.encode()))
    if "layernorm" in full_name:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if full_name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=g)
    return 0.3 * torch.randn(shape, generator=g)


def _load_full_weights(model, tied: bool) -> None:
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk, name, p in ((c, n, p) for c in _chunks(model) for n, p in c.named_parameters()):
            dim, blocks = _tp_layout(name, p)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp
            full = _full_tensor(_full_name(name, tied, getattr(chunk, "vp_stage", None)), shape)
            if dim is not None:
                parts = full.chunk(blocks, dim=dim)
                full = torch.cat([b.chunk(tp, dim=dim)[r] for b in parts], dim=dim)
            p.copy_(full)


def _gather_full_weights(model, tied: bool) -> dict:
    """{full name: full tensor} of this rank's stage (TP shards gathered), on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for chunk, name, p in ((c, n, p) for c in _chunks(model) for n, p in c.named_parameters()):
        dim, blocks = _tp_layout(name, p)
        t = p.detach().clone()
        if dim is not None and tp > 1:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            per_block = [s.chunk(blocks, dim=dim) for s in shards]
            t = torch.cat(
                [torch.cat([pb[k] for pb in per_block], dim=dim) for k in range(blocks)], dim=dim
            )
        key = _full_name(name, tied, getattr(chunk, "vp_stage", None))
        out[
            key
            + (".last_stage_copy" if key in out or (tied and name == "output_layer.weight") else "")
        ] = t
    return out


# ---------------------------------------------------------------------------- data
def _data():
    """The global batch: TokenBatch [B, S], advantages [B], old-log-prob noise [B, S], and
    token_keep [B, S] where rows 2 and 3 (micro-batch 1 at MBS 2) have no kept token."""
    return tiny_batch(LENGTHS, PROMPT, width=S, vocab=V_REAL, seed=11)


def _optimizer(kind, params):
    kw = OPTIMIZERS[kind]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=kw["lr"])
    return torch.optim.AdamW(params, lr=kw["lr"], eps=kw["eps"], weight_decay=kw["weight_decay"])


# ---------------------------------------------------------------------------- rank bodies
def _groups():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed.groups import ParallelGroups

    def g(group, size):
        return group if size > 1 else None

    return ParallelGroups(
        dp=g(ps.get_data_parallel_group(), ps.get_data_parallel_world_size()),
        tp=g(ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()),
        pp=g(ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()),
        cp=g(ps.get_context_parallel_group(), ps.get_context_parallel_world_size()),
        device=torch.device("cpu"),
        global_rank=dist.get_rank(),
    )


def _rank_layout(rank, tied, dp_rows, mbs, tokens=0, sp=False, vpp=1, pack=False):
    """score + train_step on this rank's rows (``dp_rows[dp_rank]``) of the global batch,
    micro-batches of ``mbs`` rows, or packed to ``tokens`` positions when > 0; ``sp``:
    sequence parallelism; ``vpp``: chunks of a virtual pipeline (interleaved 1F1B); ``pack``:
    rows packed end to end (THD)."""
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.optimizer import build_optimizer
    from nemo_d3s.backends.megatron.schedule import score, train_step

    groups = _groups()
    batch, adv, noise, keep = _data()
    rows = torch.tensor(dp_rows[ps.get_data_parallel_rank()], dtype=torch.long)
    local = batch.select(rows)
    model = _build(tied, sp, vpp)
    out = {"rows": rows, "dp_rank": ps.get_data_parallel_rank()}
    sc = score(
        model,
        local,
        groups,
        micro_batch_size=mbs,
        with_entropy=True,
        vocab_size=V_REAL,
        micro_batch_tokens=tokens,
        pack=pack,
    )
    out["score_stats"] = sc.stats
    out["logprobs"], out["entropy"] = sc.logprobs, sc.entropy
    old_lp = sc.logprobs + noise[rows]
    for agg in AGGS:
        denom = _denominator(keep, agg)  # the GLOBAL denominator (the trainer all-reduces it)
        for kind in OPTIMIZERS:
            _load_full_weights(model, tied)
            if kind == "adamw":  # the backend's own CPU optimizer: AdamW over this rank's shards
                kw = OPTIMIZERS[kind]
                _, opt = build_optimizer(
                    model, lr=kw["lr"], eps=kw["eps"], weight_decay=kw["weight_decay"]
                )
            else:
                opt = _optimizer(kind, [p for c in _chunks(model) for p in c.parameters()])
            loss_fn = _loss_fn(local, old_lp, adv[rows], keep[rows], agg)
            metrics = train_step(
                model,
                opt,
                local,
                loss_fn,
                groups,
                micro_batch_size=mbs,
                denominator=denom,
                grad_clip=GRAD_CLIP,
                vocab_size=V_REAL,
                micro_batch_tokens=tokens,
                pack=pack,
            )
            out[agg, kind] = (metrics, _gather_full_weights(model, tied))
    return out


def _rank_reference(rank, tied):
    """One process, TP1/PP1, plain torch on the whole batch."""
    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    batch, adv, noise, keep = _data()
    model = _build(tied)
    pos = torch.arange(S).expand(B, -1)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1).view(1, 1, S, S)
    attn = batch.attention_mask.float()

    def lp_ent():
        logits = model(batch.input_ids, pos, mask)[..., :V_REAL]
        ent, lp = entropy_and_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
        return align_to_tokens(lp) * attn, align_to_tokens(ent) * attn

    with torch.no_grad():
        lp, ent = lp_ent()
    out = {"logprobs": lp, "entropy": ent}
    old_lp = lp + noise
    for agg in AGGS:
        for kind in OPTIMIZERS:
            _load_full_weights(model, tied)
            params = list(model.parameters())
            for p in params:
                p.grad = None
            opt = _optimizer(kind, params)
            res = _loss_fn(batch, old_lp, adv, keep, agg)(lp_ent()[0], torch.arange(B))
            (res.loss / _denominator(keep, agg)).backward()
            norm = float(torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP))
            opt.step()
            metrics = {"grad_norm": norm, "loss_sum": float(res.loss.detach()), **res.metrics}
            out[agg, kind] = (metrics, {k: v.detach().clone() for k, v in model.named_parameters()})
    return out


# ---------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def reference():
    return {tied: run_ranks(_rank_reference, 1, tied, timeout=WAIT_S)[0] for tied in (True, False)}


def _initial_full_weights(ref_weights):
    return {k: _full_tensor(k, v.shape) for k, v in ref_weights.items()}


ALL_ROWS = [list(range(B))]
LAYOUTS = {
    # id: (tp, pp, world, tied, rows of each DP rank, micro-batch size)
    "tp1pp1": (1, 1, 1, True, ALL_ROWS, MBS),
    "tp2pp1": (2, 1, 2, True, ALL_ROWS, MBS),
    "tp1pp2": (1, 2, 2, True, ALL_ROWS, MBS),
    "tp2pp2": (2, 2, 4, True, ALL_ROWS, MBS),
    "tp2pp2_untied": (2, 2, 4, False, ALL_ROWS, MBS),
    # 6 rows in micro-batches of 4: the last one is short (1F1B fills it with dummy rows)
    "tp1pp2_mbs4": (1, 2, 2, True, ALL_ROWS, 4),
    # DP ranks with different numbers of micro-batches (2 and 1)
    "dp2": (1, 1, 2, True, [[0, 1, 2, 3], [4, 5]], MBS),
    "tp2dp2": (2, 1, 4, True, [[0, 1, 2, 3], [4, 5]], MBS),
    # one DP rank without rows: a zero-weight micro-batch keeps it in every collective
    "dp2_empty_rank": (1, 1, 2, True, [list(range(B)), []], MBS),
    "pp2dp2_empty_rank": (1, 2, 4, True, [[], list(range(B))], MBS),
    # token budget 20 (rows longest first: [0, 5] x 10, [2, 4] x 9, [1, 3] x 7): three
    # micro-batch shapes, so 1F1B exchanges shapes (variable_seq_lengths) at PP 2
    "tp1pp2_tokens": (1, 2, 2, True, ALL_ROWS, MBS, 20),
    "tp2pp2_tokens": (2, 2, 4, False, ALL_ROWS, MBS, 20),
    # budget 16: [0] [5] [2] [4, 1] [3] per rank, with DP ranks of unequal plans
    "tp2dp2_tokens": (2, 1, 4, True, [[0, 1, 2, 3], [4, 5]], MBS, 16),
    # sequence parallelism: widths rounded up to a multiple of TP (odd lengths 7, 9 here),
    # the layer-norm gradients summed over TP. Compared with the same one-process reference
    # and tolerances as the layouts without SP (log-probs 1e-4, SGD weights 1e-6, AdamW 1e-5),
    # so SP equals no-SP to twice those: SP changes only how the TP partial sums are combined
    # (reduce-scatter + all-gather instead of all-reduce) and the order in which a norm's
    # gradient is summed (per sequence shard, then over TP): fp32 rounding, ~1e-7 here.
    # Without the norm-gradient sum over TP the weight comparison fails (checked).
    "tp2_sp": (2, 1, 2, True, ALL_ROWS, MBS, 0, True),
    "tp2pp2_sp": (2, 2, 4, False, ALL_ROWS, MBS, 0, True),
    "tp2pp2_sp_tokens": (2, 2, 4, True, ALL_ROWS, MBS, 20, True),
    # interleaved 1F1B: PP 2 x VPP 2 chunks of one layer each (stage 0: layers 0 and 2,
    # stage 1: layers 1 and 3); 3 micro-batches padded with a zero-weight one to 4 (a
    # multiple of PP, megatron-core's interleaved schedule needs it)
    "pp2vpp2": (1, 2, 2, True, ALL_ROWS, MBS, 0, False, 2),
    "tp2pp2vpp2_untied": (2, 2, 4, False, ALL_ROWS, MBS, 0, False, 2),
    "pp2vpp2_tokens_sp": (2, 2, 4, True, ALL_ROWS, MBS, 20, True, 2),
    # packed rows (THD): budget 20 needs 3 packs, the rows spread over them as [0, 1] (17),
    # [5, 3] (14), [2, 4] (17), each row attending within itself; one width (17) per call at
    # any PP, no dummy rows
    "tp2_packed": (2, 1, 2, True, ALL_ROWS, MBS, 20, False, 1, True),
    "tp2pp2_packed": (2, 2, 4, False, ALL_ROWS, MBS, 20, False, 1, True),
    "pp2vpp2_packed": (1, 2, 2, True, ALL_ROWS, MBS, 20, False, 2, True),
    "tp2_sp_packed": (2, 1, 2, True, ALL_ROWS, MBS, 20, True, 1, True),  # width 18
    # budget 9: the rows of 10 run alone at width 10, the others at 9: two shapes at PP 2
    "tp2pp2_packed_over_budget": (2, 2, 4, False, ALL_ROWS, MBS, 9, False, 1, True),
    # no budget: packs of MBS rows of the longest row (20 positions); an empty DP rank
    # feeds one zero-weight pack
    "dp2_packed_empty_rank": (1, 1, 2, True, [list(range(B)), []], MBS, 0, False, 1, True),
    "tp2dp2_packed": (2, 1, 4, True, [[0, 1, 2, 3], [4, 5]], MBS, 16, False, 1, True),
    # context parallelism 2: every row (width 12, a multiple of 2 x CP) or pack slot (a
    # multiple of 4) cut into 4 chunks, rank r holding chunks r and 3 - r; K/V gathered over
    # CP by the local attention, log-probs by the loss function; gradients averaged over
    # DP x CP. With rows and packs, at TP 2 (+ SP), PP 2 and DP 2
    "cp2": (1, 1, 2, True, ALL_ROWS, MBS, 0, False, 1, False, 2),
    "cp2_packed": (1, 1, 2, True, ALL_ROWS, MBS, 20, False, 1, True, 2),
    "tp2cp2_sp_packed": (2, 1, 4, True, ALL_ROWS, MBS, 20, True, 1, True, 2),
    "pp2cp2": (1, 2, 4, False, ALL_ROWS, MBS, 0, False, 1, False, 2),
    "dp2cp2_packed": (1, 1, 4, True, [[0, 1, 2, 3], [4, 5]], MBS, 0, False, 1, True, 2),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, reference):
    tp, pp, world, tied, dp_rows, mbs, *extra = LAYOUTS[layout]
    tokens = extra[0] if extra else 0
    cp = extra[4] if len(extra) > 4 else 1
    results = run_ranks(
        _rank_layout, world, tied, dp_rows, mbs, *extra[:4], tp=tp, pp=pp, cp=cp, timeout=WAIT_S
    )
    ref = reference[tied]
    # every rank of one model-parallel group (same DP rank) returns IDENTICAL scores and metrics
    by_replica = {}
    for res in results:
        first = by_replica.setdefault(res["dp_rank"], res)
        for key in ("logprobs", "entropy"):
            assert torch.equal(res[key], first[key]), (layout, key)
        for agg in AGGS:
            for kind in OPTIMIZERS:
                assert res[agg, kind][0] == first[agg, kind][0], (layout, agg, kind)
    for res in results:
        rows = res["rows"]
        # (a) score: every rank of the model-parallel group holds the reference values
        for key in ("logprobs", "entropy"):
            err = (res[key] - ref[key][rows]).abs().max() if len(rows) else torch.tensor(0.0)
            assert err <= 1e-4, (layout, key, float(err))
        # (b) train_step: grad norm, metrics summed over DP, updated weights
        for agg in AGGS:
            for kind in OPTIMIZERS:
                metrics, weights = res[agg, kind]
                ref_metrics, ref_weights = ref[agg, kind]
                assert metrics["skipped"] == 0.0
                assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4), (
                    layout,
                    agg,
                    kind,
                )
                for name, w in weights.items():
                    base = name.replace(".last_stage_copy", "")
                    torch.testing.assert_close(
                        w,
                        ref_weights[base],
                        rtol=0,
                        atol=WEIGHT_ATOL[kind],
                        msg=lambda m: f"{layout} {agg} {kind} {name}: {m}",
                    )
    # a token budget feeds fewer positions than fixed micro-batches of the same rows (not
    # with interleaving at PP 2, where every micro-batch takes one shape: batches.py)
    vpp = extra[2] if len(extra) > 2 else 1
    from nemo_d3s.backends.megatron.batches import pad_for_interleaving, plan_micro_batches

    if len(extra) > 3 and extra[3]:  # packed: never more than fixed rows, less overall
        fewer = []
        for res in (r for r in results if len(r["rows"])):
            mask = _data()[0].attention_mask[res["rows"]]
            cp = extra[4] if len(extra) > 4 else 1  # (CP: widths a multiple of 2 x CP)
            plan = plan_micro_batches(
                mask, mbs, uniform=pp > 1, multiple_of=2 * cp if cp > 1 else 1
            )
            if vpp > 1:  # both plans padded to a multiple of PP micro-batches
                plan = pad_for_interleaving(plan, pp, one_shape=pp == 2)
            fixed = sum(m.b * m.width for m in plan)
            fed = res["score_stats"]["fed_tokens"]
            assert res["score_stats"]["attended_tokens"] == float(mask.sum())
            assert fed <= fixed, (layout, fed, fixed)
            fewer.append(fed < fixed)
        assert any(fewer), layout
    elif tokens and not (vpp > 1 and pp == 2):
        for res in results:
            mask = _data()[0].attention_mask[res["rows"]]
            fixed = sum(m.b * m.width for m in plan_micro_batches(mask, mbs, uniform=pp > 1))
            assert res["score_stats"]["fed_tokens"] < fixed, (layout, res["score_stats"], fixed)
            assert res["score_stats"]["attended_tokens"] == float(mask.sum())
            assert res[AGGS[0], "sgd"][0]["fed_tokens"] == res["score_stats"]["fed_tokens"]
    # the DP ranks' loss sums add up to the reference's (metrics are per-rank sums)
    for agg in AGGS:
        by_dp = {}
        for res in results:
            by_dp[res["dp_rank"]] = res[agg, "sgd"][0]
        total = sum(m["loss_sum"] for m in by_dp.values())
        assert total == pytest.approx(ref[agg, "sgd"][0]["loss_sum"], rel=1e-4, abs=1e-6)
        for key, value in ref[agg, "sgd"][0].items():
            if key.endswith("_sum") or key == "token_count":
                assert sum(m.get(key, 0.0) for m in by_dp.values()) == pytest.approx(
                    value, rel=1e-4, abs=1e-6
                ), key
    # every stage's weights were compared: the union covers the whole model
    covered = set()
    for res in results:
        covered |= {k.replace(".last_stage_copy", "") for k in res[AGGS[0], "sgd"][1]}
    assert covered == set(ref[AGGS[0], "sgd"][1])


def test_reference_is_nontrivial(reference):
    """The reference step moves every weight that should move and clipping is active, so the
    layout comparison above is not vacuous."""
    for tied, ref in reference.items():
        for agg in AGGS:
            metrics, weights = ref[agg, "sgd"]
            assert metrics["grad_norm"] > GRAD_CLIP
            init = _initial_full_weights(weights)
            moved = {k for k in weights if not torch.equal(weights[k], init[k])}
            assert moved == set(weights), set(weights) - moved


# ---------------------------------------------------------------------------- micro-batch plans
def _mask(lengths, width):
    return torch.arange(width) < torch.tensor(lengths).unsqueeze(1)


def test_plan_cuts_each_micro_batch_to_its_longest_row():
    from nemo_d3s.backends.megatron.schedule import plan_micro_batches

    plan = plan_micro_batches(_mask([3, 5, 2, 1, 9], 10), 2, uniform=False)
    assert [m.rows.tolist() for m in plan] == [[0, 1], [2, 3], [4]]
    assert [(m.b, m.width) for m in plan] == [(2, 5), (2, 2), (1, 9)]
    # sequence parallelism: widths rounded up to a multiple of TP; with a width quantum to a
    # multiple of both
    assert [
        m.width
        for m in plan_micro_batches(_mask([3, 5, 2, 1, 9], 10), 2, uniform=False, multiple_of=4)
    ] == [8, 4, 12]
    assert [
        m.width
        for m in plan_micro_batches(
            _mask([3, 5, 2, 1, 9], 10), 2, uniform=False, multiple_of=4, quantum=6
        )
    ] == [12, 12, 12]


def test_plan_for_pipelines_has_one_shape():
    from nemo_d3s.backends.megatron.schedule import plan_micro_batches

    plan = plan_micro_batches(_mask([3, 5, 2, 1, 7], 10), 2, uniform=True)
    assert [m.rows.tolist() for m in plan] == [[0, 1], [2, 3], [4]]
    assert {(m.b, m.width) for m in plan} == {(2, 7)}  # the short last one gets a dummy row


def test_plan_with_a_token_budget():
    from nemo_d3s.backends.megatron.schedule import plan_micro_batches

    mask = _mask([3, 5, 2, 1, 9], 10)
    for uniform in (False, True):  # a budget ignores the row count and the pipeline's one shape
        plan = plan_micro_batches(mask, 2, uniform=uniform, max_tokens=10)
        # widths (>= 2) 3 5 2 2 9: row 4 alone (9); rows 1, 0 (2 x 5 = 10); rows 2, 3 (2 x 2)
        assert [m.rows.tolist() for m in plan] == [[4], [1, 0], [2, 3]]
        assert [(m.b, m.width) for m in plan] == [(1, 9), (2, 5), (2, 2)]
    # sequence parallelism: the budget applies to the rounded widths
    plan = plan_micro_batches(mask, 2, uniform=False, multiple_of=4, max_tokens=16)
    assert [(m.rows.tolist(), m.width) for m in plan] == [([4], 12), ([1, 0], 8), ([2, 3], 4)]


def test_interleaved_plans_are_padded_to_a_multiple_of_pp():
    from nemo_d3s.backends.megatron.batches import pad_for_interleaving
    from nemo_d3s.backends.megatron.schedule import plan_micro_batches

    plan = plan_micro_batches(_mask([3, 5, 2, 1, 9], 10), 2, uniform=False, max_tokens=10)
    padded = pad_for_interleaving(plan, 4)  # 3 -> 4 micro-batches, the pad of the first's shape
    assert [m.rows.tolist() for m in padded] == [[4], [1, 0], [2, 3], []]
    assert [(m.b, m.width) for m in padded] == [(1, 9), (2, 5), (2, 2), (1, 9)]
    assert len(pad_for_interleaving(plan[:1], 2)) == 2 and len(pad_for_interleaving(plan, 3)) == 3
    # PP 2: one shape for all (the largest rows x width)
    assert {(m.b, m.width) for m in pad_for_interleaving(plan, 2, one_shape=True)} == {(2, 9)}


def test_packed_plan_hand_worked():
    from nemo_d3s.backends.megatron.batches import model_inputs, pad_for_interleaving, plan_packed
    from nemo_d3s.backends.base import TokenBatch

    # lengths 3, 5, 2, 1, 9, budget 10, longest first: 9 opens A (1 left), 5 opens B (5 left),
    # 3 and 2 fill B, 1 fills A
    mask = _mask([3, 5, 2, 1, 9], 10)
    plan = plan_packed(mask, 2, 10)
    assert [m.rows.tolist() for m in plan] == [[4, 3], [1, 0, 2]]
    assert [m.pack.cu_seqlens.tolist() for m in plan] == [[0, 9, 10], [0, 5, 8, 10]]
    assert [(m.b, m.width) for m in plan] == [(1, 10), (1, 10)]
    # sequence parallelism at TP 4: widths to a multiple of 4, the last slot takes the padding
    sp = plan_packed(mask, 2, 10, multiple_of=4)
    assert [m.pack.cu_seqlens.tolist() for m in sp] == [[0, 9, 12], [0, 5, 8, 12]]
    # no budget: 2 rows of the longest row's width (18): first-fit needs 2 packs, [9 5 3 1]
    # and [2]; spread over 2 they are [9 1] and [5 3 2], 10 each
    no_budget = plan_packed(mask, 2, 0)
    assert [m.rows.tolist() for m in no_budget] == [[4, 3], [1, 0, 2]]
    # one width per call: [5] and [3 1] of budget 6 are both fed at 5; with a quantum of 8 at 8
    assert [m.width for m in plan_packed(_mask([3, 5, 1], 6), 1, 6)] == [5, 5]
    assert [m.width for m in plan_packed(_mask([3, 5, 1], 6), 1, 6, quantum=8)] == [8, 8]
    # a row longer than the budget runs alone at its own width; the others keep the shared
    # width of the fullest pack within the budget (they were all widened to 32, the padding
    # attended as part of their last slot)
    over = plan_packed(_mask([32, 4, 4, 4, 4, 4, 4], 32), 1, 8)
    assert [m.rows.tolist() for m in over] == [[0], [1, 4], [2, 5], [3, 6]]
    assert [m.width for m in over] == [32, 8, 8, 8]
    assert [m.pack.max_seqlen for m in over] == [32, 4, 4, 4]
    assert [m.width for m in plan_packed(_mask([12, 3, 2], 12), 1, 8, quantum=4)] == [12, 8]
    ids = torch.arange(50).view(5, 10)
    x = model_inputs(TokenBatch(ids, mask, mask), sp[1], torch.device("cpu"))
    assert x[0].tolist() == [[10, 11, 12, 13, 14, 0, 1, 2, 20, 21, 0, 0]]
    assert x[1].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    assert x[2] is None and x[3] is None and x[4] is sp[1].pack
    # interleaving pads with a zero-weight pack of the same width; PP 2 widens all to one
    padded = pad_for_interleaving(sp[:1], 2)
    assert padded[1].rows.numel() == 0 and padded[1].pack.cu_seqlens.tolist() == [0, 12]
    two = [plan_packed(_mask([3], 3), 1, 6)[0], sp[0]]  # widths 3 and 12
    wide = pad_for_interleaving(two, 2, one_shape=True)
    assert [m.pack.width for m in wide] == [12, 12]
    assert wide[0].pack.cu_seqlens.tolist() == [0, 12]
    (empty,) = plan_packed(torch.zeros(0, 4, dtype=torch.bool), 2, 0)
    assert empty.rows.numel() == 0 and empty.pack.cu_seqlens.tolist() == [0, 2]


def test_plan_of_an_empty_batch_is_one_zero_weight_micro_batch():
    from nemo_d3s.backends.megatron.schedule import plan_micro_batches

    for uniform in (False, True):
        (mb,) = plan_micro_batches(torch.zeros(0, 10, dtype=torch.bool), 4, uniform=uniform)
        assert mb.rows.numel() == 0 and mb.b == 1 and mb.width == 2


def test_plan_rejects_bad_input():
    from nemo_d3s.backends.megatron.schedule import plan_micro_batches

    left_padded = torch.tensor([[False, True, True], [True, True, False]])
    with pytest.raises(ValueError, match="right-padded"):
        plan_micro_batches(left_padded, 2, uniform=False)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="micro_batch_size"):
            plan_micro_batches(_mask([2], 3), bad, uniform=False)


def test_score_of_an_empty_batch_needs_no_collective():
    from nemo_d3s.backends.base import TokenBatch
    from nemo_d3s.backends.megatron.schedule import score
    from nemo_d3s.distributed.groups import ParallelGroups

    empty = torch.zeros(0, 7, dtype=torch.bool)
    out = score(
        torch.nn.Linear(1, 1),
        TokenBatch(empty.long(), empty, empty),
        ParallelGroups(),
        micro_batch_size=2,
    )
    assert out.logprobs.shape == out.entropy.shape == (0, 7)
    assert (
        score(
            torch.nn.Linear(1, 1),
            TokenBatch(empty.long(), empty, empty),
            ParallelGroups(),
            micro_batch_size=2,
            with_entropy=False,
        ).entropy
        is None
    )


def test_virtual_pipeline_chunks_are_rejected():
    from nemo_d3s.backends.base import TokenBatch
    from nemo_d3s.backends.megatron.schedule import score
    from nemo_d3s.distributed.groups import ParallelGroups

    m = _mask([2], 3)
    with pytest.raises(ValueError, match="virtual pipeline"):
        score(
            [torch.nn.Linear(1, 1)] * 2,
            TokenBatch(m.long(), m, m),
            ParallelGroups(),
            micro_batch_size=2,
        )
