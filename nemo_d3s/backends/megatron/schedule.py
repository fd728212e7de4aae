"""Scoring and training steps of the Megatron backend, through megatron-core's own schedules
(no pipelining, 1F1B, or interleaved 1F1B over a virtual pipeline's chunks).

Every rank of one model-parallel group (TP x PP peers) passes the SAME ``TokenBatch`` [B, S];
a micro-batch is [b, L] (PP > 1: one L per call). The last stage turns its [b, L, V/TP] logits
into token-aligned log-probs (+ entropy) with the vocab-parallel kernel, never gathering V;
padded vocabulary columns are left out of the softmax.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.base import LossFn, Scores, TokenBatch
from nemo_d3s.backends.megatron.batches import (
    MicroBatch,
    model_inputs,
    pad_for_interleaving,
    plan_micro_batches,
    token_counts,
)
from nemo_d3s.backends.megatron.optimizer import (
    Model,
    clip_grads_,
    device_of,
    finalize_grads,
    global_grad_norm,
    is_megatron_optimizer,
    local_params,
    model_chunks,
    unwrap_model,
)
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


# ---------------------------------------------------------------------------- model plumbing
def _check_layout(groups: ParallelGroups, config, n_chunks: int) -> None:
    if groups.cp_size > 1:
        raise ValueError(
            "context parallelism is not supported by the Megatron schedule step "
            f"(cp={groups.cp_size})"
        )
    if groups.pp_size > 1 and getattr(config, "pipeline_dtype", None) is None:
        raise ValueError(
            "pipeline_model_parallel_size > 1 needs TransformerConfig.pipeline_dtype (the "
            "p2p dtype)"
        )
    if n_chunks > 1:
        from megatron.core import parallel_state as ps

        vpp = (
            ps.get_virtual_pipeline_model_parallel_world_size()
            if ps.model_parallel_is_initialized()
            else None
        )
        if groups.pp_size < 2 or vpp != n_chunks:
            raise ValueError(
                f"got {n_chunks} model chunks: a virtual pipeline (interleaved 1F1B) needs "
                f"pipeline_model_parallel_size > 1 (have {groups.pp_size}) and Megatron's virtual "
                f"pipeline size = the number of chunks (have {vpp})"
            )


def _plan(
    batch: TokenBatch,
    groups: ParallelGroups,
    chunks: List[torch.nn.Module],
    micro_batch_size: int,
    micro_batch_tokens: int,
) -> List[MicroBatch]:
    """The call's micro-batches, checked against the layout; with model chunks padded with
    zero-weight micro-batches to a multiple of PP."""
    config = getattr(unwrap_model(chunks[0]), "config", None)
    _check_layout(groups, config, len(chunks))
    multiple = groups.tp_size if getattr(config, "sequence_parallel", False) else 1
    mbs = plan_micro_batches(
        batch.attention_mask,
        micro_batch_size,
        uniform=groups.pp_size > 1,
        multiple_of=multiple,
        max_tokens=micro_batch_tokens,
    )
    if len(chunks) == 1:
        return mbs
    # PP 2: the two stages exchange activations AND gradients in one p2p batch (each is the
    # other's previous and next stage), and megatron-core's shape exchange for variable
    # shapes posts them in an order that pairs one direction's send with the other's
    # receive (p2p_communication.py:205-230): one shape for every micro-batch there.
    return pad_for_interleaving(mbs, groups.pp_size, one_shape=groups.pp_size == 2)


def _schedule(
    chunks: List[torch.nn.Module],
    micro_batches: List[MicroBatch],
    inputs: Callable[[int], Tuple[Any, ...]],
    loss_for: Callable[[int, Tuple[Any, ...]], Callable],
    *,
    forward_only: bool,
) -> None:
    """One call of Megatron's forward/backward function; ``loss_for(i, inputs(i))`` is the
    last stage's loss function for micro-batch i."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    def forward_step(data_iterator: Iterator[int], model: torch.nn.Module):
        i = next(data_iterator)
        x = inputs(i)
        out = model(x[0], x[1], x[2])
        return out, loss_for(i, x)

    first = micro_batches[0]
    n = len(micro_batches)
    # interleaved 1F1B: one data iterator per model chunk; each chunk runs every micro-batch
    # in order (megatron-core 0.16.1 schedules.py:912-916 asserts the list)
    data = [iter(range(n)) for _ in chunks] if len(chunks) > 1 else iter(range(n))
    # Micro-batches of different [L, b]: 1F1B must send each shape first, else it allocates
    # receives at [seq_length, mbs, hidden] (megatron-core 0.16.1 p2p_communication.py:301).
    # Interleaved PP 2: batched p2p would pair a gradient with an activation
    # (p2p_communication.py:18-50); the unbatched _p2p_ops (lines 53-121) keeps them apart.
    config = get_model_config(chunks[0])
    variable = len({(m.b, m.width) for m in micro_batches}) > 1
    pp2_interleaved = len(chunks) > 1 and _pp_size() == 2
    before = config.variable_seq_lengths, config.batch_p2p_comm
    config.variable_seq_lengths = before[0] or variable
    config.batch_p2p_comm = before[1] and not pp2_interleaved
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=chunks,
            num_microbatches=n,
            seq_length=first.width,  # read by 1F1B only, when every micro-batch has this shape
            micro_batch_size=first.b,
            forward_only=forward_only,
        )
    finally:
        config.variable_seq_lengths, config.batch_p2p_comm = before


def _pp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


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
) -> Scores:
    """No-grad ``Scores`` [B, S] f32 on the CPU, identical on every TP x PP rank; 0 where
    not attended. B = 0 returns empty tensors without a collective.

    ``vocab_size``: the real vocabulary when the model's is padded. Collectives: the kernel's
    three on ``groups.tp`` per micro-batch, one broadcast over ``groups.pp``. Memory on the
    last stage: one micro-batch's [b, L, V/TP] logits + a chunk_size x V/TP workspace.
    """
    chunks = model_chunks(model)
    B, S = batch.input_ids.shape
    logprobs = torch.zeros((B, S), dtype=torch.float32)
    entropy = torch.zeros((B, S), dtype=torch.float32) if with_entropy else None
    if B == 0:  # every rank of the model-parallel group holds the same (empty) batch
        return Scores(logprobs, entropy)
    device = device_of(chunks[0])
    mbs = _plan(batch, groups, chunks, micro_batch_size, micro_batch_tokens)
    store = PerTokenStore()

    def inputs(i: int):
        return model_inputs(batch, mbs[i], device)

    def loss_for(i: int, x):
        return logprob_loss_func(
            store, x[0], groups.tp, token_aligned=True, vocab_size=vocab_size, chunk_size=chunk_size
        )

    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        _schedule(chunks, mbs, inputs, loss_for, forward_only=True)
    finally:
        for c, t in zip(chunks, was_training):
            c.train(t)
    last = is_last_stage(groups.pp)
    results = broadcast_per_token(
        store if last else None, [(m.b, m.width) for m in mbs], groups.pp, device=device
    )
    for mb, res in zip(mbs, results):
        n, w = len(mb.rows), min(mb.width, S)
        keep = batch.attention_mask[mb.rows, :w].float()
        logprobs[mb.rows, :w] = res["logprobs"][:n, :w].float().cpu() * keep
        if with_entropy:
            entropy[mb.rows, :w] = res["entropy"][:n, :w].float().cpu() * keep
    return Scores(logprobs, entropy, token_counts(batch, mbs))


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
) -> Dict[str, float]:
    """One optimizer step over this rank's ``batch`` [B, S] (B may be 0: a zero-weight dummy
    micro-batch joins every collective); collective over every rank of the job.

    ``loss_fn`` runs on the last stage and returns a loss SUM; scaled by
    ``StepNormalizer(denominator, dp, n_micro, megatron_schedule=True)`` the gradient is
    grad(global sum / D) for any micro-batching and layout. Torch optimizer: grads finalised
    here (DP average, tied embeddings, TP partial grads), clipped on the TP x PP norm, step
    skipped on every rank if it is not finite; Megatron optimizer: its DDP and ``step``.
    Returns the ``Policy.train_step`` floats, same on a model-parallel group; metric sums
    are this rank's.
    """
    chunks = model_chunks(model)
    inner = unwrap_model(chunks[0])
    device = device_of(chunks[0])
    B, S = batch.input_ids.shape
    mbs = _plan(batch, groups, chunks, micro_batch_size, micro_batch_tokens)
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

    def loss_for(i: int, x):
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

    _schedule(chunks, mbs, inputs, loss_for, forward_only=False)

    lr = float(optimizer.param_groups[0]["lr"])
    last = is_last_stage(groups.pp)
    local = None
    if last:
        keys = sorted(sums)
        values = torch.stack([sums[k] for k in keys]).cpu().tolist() if keys else []  # one copy
        local = dict(zip(keys, values))
    metrics = _broadcast_metrics(local, groups)

    if megatron_opt:
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
