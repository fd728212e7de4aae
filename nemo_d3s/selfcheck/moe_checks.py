"""A tiny mixture of experts through the Megatron backend: the GRPO step of
``model_checks.one_step`` at expert parallelism, compared with EP 1.

- ``moe.local_spec``: a random Qwen3-MoE (4 experts, top-2; written to the work folder by
  rank 0), megatron-core's local spec (``SequentialMLP`` experts), fp32, on this machine's
  device (gloo on the CPU, NCCL on CUDA): EP 1 against EP = 2 with the all-to-all and the
  all-gather dispatchers (an even world): log-probs and entropies within 1e-4, grad norm
  within rel 1e-4, weights after the step within 1e-5.
- ``moe.router_replay``: the same model at EP = 2 (an even world; else 1), fp32 local spec,
  on this machine's device: the scoring pass records the routers' own routing (joined over
  the ranks: one all-reduce MAX per parallel group, NCCL on CUDA), replaying it gives the
  same log-probs (1e-6), replaying another routing (each expert + 1 mod E) moves them
  (> 1e-3), and a train step replaying it has a finite gradient.
- ``moe.te_grouped_gemm`` (CUDA): the Transformer Engine spec with grouped-GEMM experts
  (``TEGroupedMLP``) in bf16, the all-to-all dispatcher over NCCL at EP = 2 (an even world),
  against the fp32 local spec at EP 1, with ``gpt.te_spec``'s bf16 bounds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Dict

import torch

from nemo_d3s.selfcheck.base import Check, Context, max_abs_diff, megatron_backend
from nemo_d3s.selfcheck.model_checks import LR, bf16_bounds, fp32_bounds, one_step
from nemo_d3s.selfcheck.report import CheckFailed

__all__ = ["CHECKS", "build_tiny_moe", "ep_size", "moe_context"]


def build_tiny_moe(folder: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """A random Qwen3-MoE (2 layers, 4 experts of width 32, top-2, renormalised; ``head_dim``
    16, or 64 where vLLM's attention kernels need it) with the byte-level tokenizer, in
    ``folder`` (HF layout)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from nemo_d3s.backends.hf.loading import byte_level_tokenizer

    tok = byte_level_tokenizer()
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def moe_context(ctx: Context, head_dim: int = 16) -> Context:
    """``ctx`` with the tiny MoE as its model (written by rank 0, then a barrier)."""
    folder = ctx.work_dir / ("tiny_moe" if head_dim == 16 else f"tiny_moe_hd{head_dim}")
    if ctx.rank == 0 and not (folder / "config.json").is_file():
        build_tiny_moe(folder, head_dim=head_dim)
    ctx.barrier()
    return replace(ctx, model_dir=folder)


def _step(ctx: Context, **params):
    with megatron_backend(ctx, lr=LR, adam_eps=1e-3, grad_clip=0.0, **params) as pol:
        before = {k: v.detach().float().cpu().clone() for k, v in pol.hf_weights()}
        return before, one_step(pol)


def ep_size(ctx: Context) -> int:
    """EP 2 in an even world, else 1."""
    return 2 if ctx.world % 2 == 0 else 1


def check_local_spec(ctx: Context) -> Dict[str, Any]:
    mctx = moe_context(ctx)
    kw = dict(dtype="float32", transformer_impl="local", distributed_optimizer=False)
    _, (lp1, ent1, m1, w1) = _step(mctx, **kw)
    out: Dict[str, Any] = {"ranks": ctx.world, "grad_norm_ep1": m1["grad_norm"]}
    if ep_size(ctx) == 1:
        out["note"] = "an odd world: EP 1 only (forward, backward, step ran)"
        if not torch.isfinite(lp1).all() or not m1["grad_norm"] > 0:
            raise CheckFailed("non-finite log-probs or zero gradient", out)
        return out
    err = dict.fromkeys(("logprob_err", "entropy_err", "grad_norm_rel_err", "weights_err"), 0.0)
    out["dispatchers"] = ["alltoall", "allgather"]
    for dispatcher in out["dispatchers"]:
        _, (lp, ent, m, w) = _step(
            mctx, **kw, expert_model_parallel_size=2, moe_token_dispatcher_type=dispatcher
        )
        err["logprob_err"] = max(err["logprob_err"], max_abs_diff(lp1, lp))
        err["entropy_err"] = max(err["entropy_err"], max_abs_diff(ent1, ent))
        rel = abs(m1["grad_norm"] - m["grad_norm"]) / max(m1["grad_norm"], 1e-12)
        err["grad_norm_rel_err"] = max(err["grad_norm_rel_err"], rel)
        err["weights_err"] = max(err["weights_err"], max(max_abs_diff(w1[k], w[k]) for k in w1))
    fp32_bounds(err, out)
    return out


def check_router_replay(ctx: Context) -> Dict[str, Any]:
    from nemo_d3s.core.losses import loss_denominator
    from nemo_d3s.trainer.update import one_minibatch_loss_fn

    from nemo_d3s.selfcheck.model_checks import step_batch

    mctx = moe_context(ctx)
    ep = ep_size(ctx)
    batch, adv, noise = step_batch()
    params = dict(dtype="float32", transformer_impl="local", distributed_optimizer=False)
    params.update(expert_model_parallel_size=ep, moe_record_routing=True)
    with megatron_backend(mctx, lr=LR, adam_eps=1e-3, grad_clip=0.0, **params) as pol:
        plain = pol.score(batch, with_entropy=False, micro_batch_size=2)
        own = plain.routed_experts
        if own is None or not bool((own[batch.attention_mask] >= 0).all()):
            raise CheckFailed("the scoring pass recorded no routing for some real token")
        same = pol.score(replace(batch, routed_experts=own), with_entropy=False, micro_batch_size=2)
        experts = int(pol.spec.num_experts)
        other = torch.where(own >= 0, (own + 1) % experts, own).to(torch.int16)
        moved = pol.score(
            replace(batch, routed_experts=other), with_entropy=False, micro_batch_size=2
        )
        resp = batch.response_mask
        out: Dict[str, Any] = {
            "ep": ep,
            "own_replay_logprob_err": max_abs_diff(plain.logprobs[resp], same.logprobs[resp]),
            "other_replay_logprob_change": max_abs_diff(plain.logprobs[resp], moved.logprobs[resp]),
        }
        loss_fn = one_minibatch_loss_fn(batch, moved.logprobs + noise, adv, resp)
        denominator = float(loss_denominator(resp, "token_mean")) * pol.groups.dp_size
        m = pol.train_step(
            replace(batch, routed_experts=other), loss_fn, 2, denominator=denominator
        )
        out["grad_norm"] = m["grad_norm"]
    if out["own_replay_logprob_err"] > 1e-6 or out["other_replay_logprob_change"] <= 1e-3:
        raise CheckFailed(
            "replaying the recorded routing changed the log-probs, or another did not", out
        )
    if not (m["grad_norm"] > 0 and m["grad_norm"] < float("inf")):
        raise CheckFailed("a replayed train step gave no finite gradient", out)
    return out


def check_te_grouped_gemm(ctx: Context) -> Dict[str, Any]:
    from nemo_d3s.backends.megatron.model import transformer_engine_error

    err = transformer_engine_error()
    if err is not None:
        raise CheckFailed(f"Transformer Engine: {err}")
    mctx = moe_context(ctx)
    _, (lp_ref, _, m_ref, _) = _step(
        mctx, dtype="float32", transformer_impl="local", distributed_optimizer=False
    )
    ep = ep_size(ctx)
    before, (lp, _, m, w) = _step(
        mctx,
        dtype="bfloat16",
        transformer_impl="transformer_engine",
        distributed_optimizer=False,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type="alltoall",
    )
    out: Dict[str, Any] = {"ep": ep, "dtype": "bfloat16", "dispatcher": "alltoall"}
    bf16_bounds(lp, lp_ref, m, m_ref, w, before, out)
    return out


CHECKS = [
    Check("moe.local_spec", False, check_local_spec),
    Check("moe.router_replay", False, check_router_replay),
    Check(
        "moe.te_grouped_gemm",
        True,
        check_te_grouped_gemm,
        "a tiny Qwen3-MoE on the Transformer Engine spec (grouped-GEMM experts), bf16, the "
        "all-to-all dispatcher over NCCL at EP 2, against the fp32 local spec at EP 1",
    ),
]
