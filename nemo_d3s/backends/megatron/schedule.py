"""Scoring and training steps of the Megatron backend, through megatron-core's own schedules
(no pipelining, 1F1B, or interleaved 1F1B over a virtual pipeline's chunks).

Every rank of one model-parallel group (TP x PP peers, each CP rank its own positions) passes
the SAME ``TokenBatch`` [B, S]; a micro-batch is [b, L] (PP > 1: one L per call) or a pack
[1, T] of rows end to end (THD). The last stage turns its [b, L, V/TP] logits into
token-aligned log-probs (+ entropy) with the vocab-parallel kernel, never gathering V;
padded vocabulary columns are left out of the softmax.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Optional

import torch
import torch.distributed as dist

from nemo_d3s.backends.base import LossFn, Scores, TokenBatch
from nemo_d3s.backends.megatron.batches import (
    MicroBatch,
    model_inputs,
    plan_micro_batches,
    token_counts,
)
from nemo_d3s.backends.megatron.forward_backward import plan_call, run_schedule
from nemo_d3s.backends.megatron.optimizer import (
    Model,
    clip_grads_,
    device_of,
    finalize_grads,
    global_grad_norm,
    is_megatron_optimizer,
    local_params,
    megatron_grads_finite,
    model_chunks,
    unwrap_model,
)
from nemo_d3s.backends.megatron.moe import couples_data_parallel
from nemo_d3s.backends.megatron.routing import RouterTaps, combine_recorded
from nemo_d3s.core.routing import NO_EXPERT
from nemo_d3s.backends.megatron.sequence_parallel import allreduce_tp_partial_grads
from nemo_d3s.distributed.comm import global_rank_of, group_size, is_single
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.distributed.normalizers import StepNormalizer
from nemo_d3s.distributed.pipeline import (
    PerTokenStore,
    broadcast_per_token,
    is_last_stage,
    logprob_loss_func,
    train_loss_func,
)

__all__ = ["MicroBatch", "plan_micro_batches", "score", "train_step"]


# ---------------------------------------------------------------------------- scoring
@torch.no_grad()
def score(
    model: Model,
    batch: TokenBatch,
    groups: ParallelGroups,
    *,
    micro_batch_size: int,
    with_entropy: bool = True,
    vocab_size: Optional[int] = None,
    chunk_size: int = 1024,
    micro_batch_tokens: int = 0,
    pack: bool = False,
    width_quantum: int = 0,
    taps: Optional[RouterTaps] = None,
    record_routing: bool = False,
    temperature: float = 1.0,
) -> Scores:
    """No-grad ``Scores`` [B, S] f32 on the CPU, identical on every TP x PP rank; 0 where
    not attended. B = 0 returns empty tensors without a collective, unless a MoE layer's
    dispatch needs this rank (``moe.couples_data_parallel``).

    ``vocab_size``: the real vocabulary when the model's is padded. ``pack``: packs instead
    of rows; widths are multiples of ``width_quantum``. Collectives: the kernel's three on
    ``groups.tp`` per micro-batch, one broadcast over ``groups.pp``. Memory on the last
    stage: one micro-batch's [b, L, V/TP] logits + a chunk_size x V/TP workspace.

    A mixture of experts (``taps``, ``routing.RouterTaps``): ``batch.routed_experts`` is
    replayed; ``record_routing`` returns the routers' own choice as ``Scores.routed_experts``
    [B, S, L, K] int16 (``routing.combine_recorded``: one all-reduce of it in int32 over each
    of TP, CP and PP).
    """
    chunks = model_chunks(model)
    B, S = batch.input_ids.shape
    logprobs = torch.zeros((B, S), dtype=torch.float32)
    entropy = torch.zeros((B, S), dtype=torch.float32) if with_entropy else None
    record = taps is not None and taps.is_moe and record_routing
    if B == 0 and not couples_data_parallel(chunks, groups):
        # the model-parallel group's batch is empty
        routed = (
            torch.zeros((0, S, taps.num_layers, taps.topk), dtype=torch.int16) if record else None
        )
        return Scores(logprobs, entropy, routed_experts=routed)
    device = device_of(chunks[0])
    mbs = plan_call(
        batch, groups, chunks, micro_batch_size, micro_batch_tokens, pack, width_quantum
    )
    store = PerTokenStore()
    routing = _routing_call(taps, batch, mbs, groups, chunks, record, training=False)

    def inputs(i: int):
        return model_inputs(batch, mbs[i], device)

    def loss_for(i: int, x, cp):
        return logprob_loss_func(
            store,
            x[0],
            groups.tp,
            token_aligned=True,
            vocab_size=vocab_size,
            chunk_size=chunk_size,
            cp=cp,
            temperature=temperature,
        )

    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with routing as around:
            run_schedule(
                chunks, mbs, inputs, loss_for, forward_only=True, cp_group=groups.cp, around=around
            )
            own = taps.recorded() if record else None
    finally:
        for c, t in zip(chunks, was_training):
            c.train(t)
    routed = None
    if own is not None:  # real tokens only, as the HF backend records
        routed = combine_recorded(own, groups, device)
        routed[~batch.attention_mask.bool()] = NO_EXPERT
    last = is_last_stage(groups.pp)
    results = broadcast_per_token(
        store if last else None, [(m.b, m.width) for m in mbs], groups.pp, device=device
    )
    for mb, res in zip(mbs, results):
        n, w = len(mb.rows), S if mb.pack is not None else min(mb.width, S)
        keep = batch.attention_mask[mb.rows, :w].float()
        for name, out in (("logprobs", logprobs), ("entropy", entropy)):
            if out is None:
                continue
            x = res[name].float().cpu()
            x = x[:n, :w] if mb.pack is None else mb.pack.unpack(x[0], w)
            out[mb.rows, :w] = x * keep
    return Scores(logprobs, entropy, token_counts(batch, mbs), routed_experts=routed)


def _routing_call(taps, batch: TokenBatch, mbs, groups, chunks, record: bool, training: bool):
    """``taps.call`` for this schedule call (a context yielding ``run_schedule``'s ``around``);
    a routing to replay with no MoE routers to take it is a ValueError. Under full activation
    recomputation (``gradient_checkpointing``: every layer, ``model.transformer_config``) a
    training call keeps each replayed target for the backward's recomputed forward. A training
    call with router losses on masks their padding (``router_losses``)."""
    if taps is None or not taps.is_moe:
        if batch.routed_experts is not None:
            raise ValueError("router replay: a dense model (or the reference) routes nothing")
        return contextlib.nullcontext()
    config = unwrap_model(chunks[0]).config
    sp = bool(getattr(config, "sequence_parallel", False))
    granularity = getattr(config, "recompute_granularity", None)
    if batch.routed_experts is not None and granularity not in (None, "full"):
        raise ValueError(
            f"router replay with recompute_granularity={granularity!r} is not built (full "
            "recomputation replays each layer's routing in the backward)"
        )
    recompute = training and granularity == "full"
    return taps.call(
        batch,
        mbs,
        groups,
        sequence_parallel=sp,
        record=record,
        recompute=recompute,
        training=training,
    )


# ---------------------------------------------------------------------------- training
def _broadcast_metrics(
    sums: Optional[Dict[str, float]], groups: ParallelGroups
) -> Dict[str, float]:
    """The last stage's metric sums on every stage: one object broadcast over ``groups.pp``."""
    if is_single(groups.pp):
        return dict(sums or {})
    box = [sums if is_last_stage(groups.pp) else None]
    dist.broadcast_object_list(
        box, src=global_rank_of(groups.pp, group_size(groups.pp) - 1), group=groups.pp
    )
    return dict(box[0])


def train_step(
    model: Model,
    optimizer,
    batch: TokenBatch,
    loss_fn: LossFn,
    groups: ParallelGroups,
    *,
    micro_batch_size: int,
    denominator: float,
    grad_clip: Optional[float] = None,
    vocab_size: Optional[int] = None,
    lr_scheduler=None,
    chunk_size: int = 1024,
    micro_batch_tokens: int = 0,
    pack: bool = False,
    width_quantum: int = 0,
    taps: Optional[RouterTaps] = None,
    temperature: float = 1.0,
) -> Dict[str, float]:
    """One optimizer step over this rank's ``batch`` [B, S] (B may be 0: a zero-weight dummy
    micro-batch joins every collective); collective over every rank of the job.

    ``loss_fn`` runs on the last stage and returns a loss SUM (packs: still per row);
    scaled by ``StepNormalizer(denominator, dp, n_micro, megatron_schedule=True)`` the
    gradient is grad(global sum / D) for any micro-batching, packing and layout. Torch
    optimizer: grads finalised here (DP (x CP) average, tied embeddings, TP partial grads),
    clipped on the TP x PP norm, step skipped on every rank if it is not finite; Megatron
    optimizer: its DDP and ``step``, skipped on every rank when a gradient is not finite.
    Returns the ``Policy.train_step`` floats, same on a model-parallel group; metric sums are
    this rank's. A mixture of experts (``taps``): ``batch.routed_experts`` is replayed in every
    forward.
    """
    chunks = model_chunks(model)
    inner = unwrap_model(chunks[0])
    device = device_of(chunks[0])
    B, S = batch.input_ids.shape
    mbs = plan_call(
        batch, groups, chunks, micro_batch_size, micro_batch_tokens, pack, width_quantum
    )
    n_real = sum(1 for m in mbs if len(m.rows))
    normalizer = StepNormalizer(
        float(denominator), groups.dp_size, len(mbs), megatron_schedule=True
    )
    megatron_opt = is_megatron_optimizer(optimizer)

    sums: Dict[str, torch.Tensor] = {}

    def add(name: str, value: torch.Tensor) -> None:
        v = value.detach().to(torch.float64)
        sums[name] = sums[name] + v if name in sums else v

    def inputs(i: int):
        return model_inputs(batch, mbs[i], device)

    def loss_for(i: int, x, cp):
        mb = mbs[i]
        return train_loss_func(
            x[0],
            x[3],
            mb.rows,
            loss_fn,
            normalizer,
            groups.tp,
            width=S,
            on_sum=add,
            vocab_size=vocab_size,
            chunk_size=chunk_size,
            pack=x[4],
            cp=cp,
            temperature=temperature,
        )

    for c in chunks:
        c.train()
    if megatron_opt:  # Megatron's DDP keeps grads in its own buffers
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
    else:
        for p in local_params(chunks):
            p.grad = None
            if getattr(p, "main_grad", None) is not None:  # (main_weights: fp32 accumulation)
                p.main_grad = None

    with _routing_call(taps, batch, mbs, groups, chunks, False, training=True) as around:
        run_schedule(
            chunks, mbs, inputs, loss_for, forward_only=False, cp_group=groups.cp, around=around
        )

    lr = float(optimizer.param_groups[0]["lr"])
    last = is_last_stage(groups.pp)
    local = None
    if last:
        keys = sorted(sums)
        values = torch.stack([sums[k] for k in keys]).cpu().tolist() if keys else []  # one copy
        local = dict(zip(keys, values))
    metrics = _broadcast_metrics(local, groups)

    if megatron_opt:
        ok, norm = False, None
        if megatron_grads_finite(chunks, groups):  # (its step would apply them)
            ok, norm, _ = optimizer.step()
            if norm is None:
                norm = optimizer.get_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        skipped = not ok
    else:
        finalize_grads(chunks, groups)
        qk = bool(getattr(inner.config, "qk_layernorm", False))
        if qk or getattr(inner.config, "sequence_parallel", False):
            # Megatron's DDP does it in finalize_model_grads
            allreduce_tp_partial_grads(chunks, groups, qk_layernorm=qk)
        grad_norm = float(global_grad_norm(chunks, groups))
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            clip_grads_(chunks, grad_clip, grad_norm)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if not skipped and lr_scheduler is not None:
        lr_scheduler.step()
    metrics.update(
        grad_norm=grad_norm, lr=lr, skipped=float(skipped), n_micro_batches=float(n_real)
    )
    metrics.update(token_counts(batch, mbs))
    return metrics
