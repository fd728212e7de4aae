"""A small GPT through the Megatron backend: one GRPO step (4 rows of 16 tokens, every response
token kept) at TP1 x PP1 against the parallel layouts the world allows.
``gpt.local_spec`` (fp32; TP2, PP2, TP2 x PP2), ``gpt.long_sequence`` (sequence parallelism,
token-budget micro-batches, PP2 x VPP2) and ``gpt.packed_cp`` (packed rows, CP2 on rows and
packs: the CPU twin of ``gpt.te_thd`` / ``gpt.te_cp``): log-probs within 1e-4, grad norm within
rel 1e-4, weights after the step within 1e-5. ``gpt.te_spec`` / ``gpt.te_spec_sp`` /
``gpt.te_thd`` / ``gpt.te_cp`` (CUDA, bf16, distributed optimizer; SP, TE's THD attention, CP2
over NCCL) against the fp32 local spec: mean |log-prob diff| <= 0.05, max <= 0.5, grad norm
within rel 0.1, every weight moved (bf16's bounds: they catch mapping errors).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import torch

from nemo_d3s.selfcheck.base import (
    Check,
    Context,
    max_abs_diff,
    megatron_backend,
    need_world,
    within,
)
from nemo_d3s.selfcheck.report import CheckFailed

__all__ = ["CHECKS", "bf16_bounds", "fp32_bounds", "one_step", "step_batch"]

LR = 1e-2


def step_batch(rows: int = 4, width: int = 16, seed: int = 3):
    """(TokenBatch [rows, width], advantages [rows], old-log-prob noise [rows, width]) on the
    CPU."""
    from nemo_d3s.backends.base import TokenBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(
        [width, width - 3, width - 5, width - 1][:rows] + [width] * max(0, rows - 4)
    )
    prompt = torch.tensor([3, 4, 5, 6][:rows] + [3] * max(0, rows - 4))
    pos = torch.arange(width)
    attn = pos < lengths.unsqueeze(1)
    resp = attn & (pos >= prompt.unsqueeze(1))
    ids = torch.randint(1, 256, (rows, width), generator=g) * attn
    return (
        TokenBatch(ids, attn, resp),
        torch.randn(rows, generator=g),
        0.1 * torch.randn(rows, width, generator=g),
    )


def one_step(
    pol, micro_batch_tokens: int = 0
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float], Dict[str, torch.Tensor]]:
    """(log-probs [B, S], entropy [B, S], train metrics, HF-named weights after the step) of one
    GRPO step on :func:`step_batch`; collective over the backend's world. Micro-batches of 2 rows,
    or packed to ``micro_batch_tokens`` when > 0.
    """
    from nemo_d3s.core.losses import LossConfig, loss_denominator
    from nemo_d3s.trainer.update import UpdateBatch, make_loss_fn

    batch, adv, noise = step_batch()
    sc = pol.score(
        batch, with_entropy=True, micro_batch_size=2, micro_batch_tokens=micro_batch_tokens
    )
    keep = batch.response_mask
    upd = UpdateBatch(
        batch=batch,
        old_logprobs=sc.logprobs.detach() + noise,
        advantages=adv,
        token_keep=keep,
        minibatch=torch.zeros(len(batch), dtype=torch.long),
    )
    loss_fn = make_loss_fn("grpo", LossConfig(aggregation="token_mean", check_inputs=False), upd)
    denominator = (
        float(loss_denominator(keep, "token_mean")) * pol.groups.dp_size
    )  # the same rows on every DP rank
    metrics = pol.train_step(
        batch, loss_fn, 2, denominator=denominator, micro_batch_tokens=micro_batch_tokens
    )
    weights = {k: v.detach().float().cpu().clone() for k, v in pol.hf_weights()}
    return sc.logprobs.detach().cpu(), sc.entropy.detach().cpu(), metrics, weights


def _run(ctx: Context, tp: int, pp: int = 1, micro_batch_tokens: int = 0, **params):
    # adam_eps 1e-3: Adam's first step is lr g / (|g| + eps), which blows float noise in tiny
    # gradient entries up to +-lr at eps 1e-8 (the tests' setting for the same comparison).
    with megatron_backend(
        ctx,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        lr=LR,
        adam_eps=1e-3,
        grad_clip=0.0,
        **params,
    ) as pol:
        before = {k: v.detach().float().cpu().clone() for k, v in pol.hf_weights()}
        return before, one_step(pol, micro_batch_tokens)


def _weights_err(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise CheckFailed(f"the layouts export different tensors: {sorted(set(a) ^ set(b))[:4]}")
    return max(max_abs_diff(a[k], b[k]) for k in a)


def layouts(ctx: Context) -> List[Tuple[int, int]]:
    """The (TP, PP) layouts compared with TP1 x PP1 on this world: TP2 and PP2 on an even
    world, TP2 x PP2 on a multiple of 4 (PP only when it divides the model's layers)."""
    layers = int(
        json.loads((ctx.model_dir / "config.json").read_text()).get("num_hidden_layers", 1)
    )
    out = []
    if ctx.world % 2 == 0:
        out.append((2, 1))
        if layers % 2 == 0:
            out.append((1, 2))
            if ctx.world % 4 == 0:
                out.append((2, 2))
    return out


def long_sequence_layouts(ctx: Context) -> Dict[str, Dict[str, Any]]:
    """name -> ``_run`` arguments of the long-sequence variants this world allows."""
    layers = int(
        json.loads((ctx.model_dir / "config.json").read_text()).get("num_hidden_layers", 1)
    )
    out: Dict[str, Dict[str, Any]] = {}
    if ctx.world % 2 == 0:
        out["tp2_sp"] = dict(tp=2, pp=1, sequence_parallel=True)
        if layers % 2 == 0:
            out["pp2_tokens"] = dict(
                tp=1, pp=2, micro_batch_tokens=24
            )  # 4 rows of 11-16 tokens: 3 shapes
        if layers % 4 == 0:
            out["pp2_vpp2"] = dict(tp=1, pp=2, virtual_pipeline_model_parallel_size=2)
    return out


def check_local_spec(ctx: Context) -> Dict[str, Any]:
    return compare_layouts(ctx, {f"tp{tp}pp{pp}": dict(tp=tp, pp=pp) for tp, pp in layouts(ctx)})


def check_long_sequence(ctx: Context) -> Dict[str, Any]:
    need_world(ctx, 2, "the long-sequence layouts (TP 2 / PP 2)")
    return compare_layouts(ctx, long_sequence_layouts(ctx))


def compare_layouts(ctx: Context, variants: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """TP1 x PP1 against each of ``variants`` (name -> ``_run`` arguments), fp32 local spec."""
    kw = dict(dtype="float32", transformer_impl="local", distributed_optimizer=False)
    _, (lp1, ent1, m1, w1) = _run(ctx, 1, 1, **kw)
    out: Dict[str, Any] = {"ranks": ctx.world, "grad_norm_tp1pp1": m1["grad_norm"]}
    others = list(variants)
    if not others:
        out["note"] = "one rank: TP1 x PP1 only (forward, backward, step ran)"
        if not torch.isfinite(lp1).all() or not m1["grad_norm"] > 0:
            raise CheckFailed("non-finite log-probs or zero gradient", out)
        return out
    out["layouts"] = others
    err = dict.fromkeys(("logprob_err", "entropy_err", "grad_norm_rel_err", "weights_err"), 0.0)
    for name in others:
        _, (lp, ent, m, w) = _run(ctx, **{**kw, **variants[name]})
        err["logprob_err"] = max(err["logprob_err"], max_abs_diff(lp1, lp))
        err["entropy_err"] = max(err["entropy_err"], max_abs_diff(ent1, ent))
        err["grad_norm_rel_err"] = max(
            err["grad_norm_rel_err"],
            abs(m1["grad_norm"] - m["grad_norm"]) / max(m1["grad_norm"], 1e-12),
        )
        err["weights_err"] = max(err["weights_err"], _weights_err(w1, w))
    fp32_bounds(err, out)
    return out


def fp32_bounds(err: Dict[str, float], out: Dict[str, Any]) -> None:
    """The fp32 layout comparison's bounds (the tests' for the same comparison): log-probs
    and entropies 1e-4, grad norm rel 1e-4, weights after the step 1e-5."""
    for name, bound in (
        ("logprob_err", 1e-4),
        ("entropy_err", 1e-4),
        ("grad_norm_rel_err", 1e-4),
        ("weights_err", 1e-5),
    ):
        within(name, err[name], bound, out)


def check_te_spec(ctx: Context, tp: Optional[int] = None, **params) -> Dict[str, Any]:
    """The TE spec in bf16 at ``tp`` (default ``ctx.tp``) with backend ``params`` against the fp32
    local spec at TP1 x PP1, within ``gpt.te_spec``'s bounds.
    """
    from nemo_d3s.backends.megatron.model import transformer_engine_error

    tp = ctx.tp if tp is None else tp
    err = transformer_engine_error()
    if err is not None:
        raise CheckFailed(f"Transformer Engine: {err}")
    _, (lp_ref, _, m_ref, _) = _run(
        ctx, 1, dtype="float32", transformer_impl="local", distributed_optimizer=False
    )
    params = {"distributed_optimizer": True, **params}
    before, (lp, _, m, w) = _run(
        ctx, tp, dtype="bfloat16", transformer_impl="transformer_engine", **params
    )
    out: Dict[str, Any] = {"tp": tp, "dtype": "bfloat16", **params}
    bf16_bounds(lp, lp_ref, m, m_ref, w, before, out)
    return out


def bf16_bounds(lp, lp_ref, m, m_ref, w, before, out: Dict[str, Any]) -> None:
    """A bf16 step against the fp32 reference (the module docstring's bounds): log-probs
    ``lp`` vs ``lp_ref``, grad norms of the metrics ``m`` vs ``m_ref``, and every weight of
    ``w`` moved from ``before``."""
    diff = (lp - lp_ref).abs()
    within("logprob_mean_err", float(diff.mean()), 0.05, out)
    within("logprob_max_err", float(diff.max()), 0.5, out)
    within(
        "grad_norm_rel_err",
        abs(m["grad_norm"] - m_ref["grad_norm"]) / max(m_ref["grad_norm"], 1e-12),
        0.1,
        out,
    )
    still = [k for k in w if torch.equal(w[k], before[k])]
    out["tensors_unchanged"] = len(still)
    if still:
        raise CheckFailed(
            f"{len(still)} weight tensors did not move in the step (e.g. {still[0]})", out
        )


def check_te_spec_sp(ctx: Context) -> Dict[str, Any]:
    need_world(ctx, 2, "sequence parallelism (TP 2)")
    return check_te_spec(ctx, sequence_parallel=True)


def packed_cp_layouts(ctx: Context) -> Dict[str, Dict[str, Any]]:
    """name -> ``_run`` arguments: packed rows (THD) at TP1; context parallelism 2 on rows
    and on packs when the world is even."""
    out: Dict[str, Dict[str, Any]] = {"packed": dict(tp=1, pack_sequences=True)}
    if ctx.world % 2 == 0:
        out["cp2"] = dict(tp=1, context_parallel_size=2)
        out["cp2_packed"] = dict(tp=1, context_parallel_size=2, pack_sequences=True)
    return out


def check_packed_cp(ctx: Context) -> Dict[str, Any]:
    return compare_layouts(ctx, packed_cp_layouts(ctx))


def check_te_thd(ctx: Context) -> Dict[str, Any]:
    return check_te_spec(ctx, pack_sequences=True)


def check_te_cp(ctx: Context) -> Dict[str, Any]:
    need_world(ctx, 2, "context parallelism 2")
    return check_te_spec(ctx, tp=1, context_parallel_size=2)  # packed (TE's default): THD + CP


CHECKS = [
    Check("gpt.local_spec", False, check_local_spec),
    Check("gpt.long_sequence", False, check_long_sequence),
    Check("gpt.packed_cp", False, check_packed_cp),
    Check(
        "gpt.te_thd",
        True,
        check_te_thd,
        "gpt.te_spec with packed rows: PackedSeqParams (THD) through TE's attention",
    ),
    Check(
        "gpt.te_cp",
        True,
        check_te_cp,
        "gpt.te_spec at CP 2 over NCCL: TE's context-parallel attention, log-probs gathered "
        "over CP, gradients averaged over DP x CP",
    ),
    Check(
        "gpt.te_spec",
        True,
        check_te_spec,
        "the Transformer Engine spec, bf16, Megatron's distributed optimizer at TP2 against the "
        "fp32 local spec at TP1: log-probs, grad norm, every weight moved",
    ),
    Check(
        "gpt.te_spec_sp",
        True,
        check_te_spec_sp,
        "gpt.te_spec with sequence parallelism (TE's fused norms' gradient summed over TP)",
    ),
]
