"""Per-token entropy and target log-probability from vocab-sharded logits [B, S, V/TP].

Each TP rank holds a contiguous vocabulary slice (TP order; widths may differ). With M the max logit
(all-reduce MAX), s = sum exp(z - M), t = sum exp(z - M)(z - M) and the target's u_y = z_y - M (one
all-reduce SUM of [3, N]): log p(y) = u_y - log s, H = log s - t / s. The vocabulary is never
gathered; the backward (onehot(y) - softmax) needs only local logits and the saved global lse, so it
runs no collective. Padded vocabularies: columns with id >= ``vocab_size`` are left out of the
softmax and get zero gradient."""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.core.entropy import (
    at_temperature,
    check_logits_and_targets,
    check_reduced_finite,
    check_temperature,
    compute_dtype,
    flat_view,
    token_block,
    token_chunks,
)
from nemo_d3s.distributed.comm import all_gather_counts, collective_device, group_rank, is_single

__all__ = ["vocab_parallel_entropy_and_logprobs", "vocab_shard_range"]

# exp(u) underflows to exactly 0 in fp32 (and fp64) long before u = -1e4, so flooring the
# shifted logits there changes no sum, and it turns -inf logits (masked vocabulary entries)
# into finite ones, so that e * u is 0 instead of 0 x (-inf) = NaN.
_SHIFT_FLOOR = -1.0e4


def vocab_shard_range(
    local_width: int, tp_group: Optional[dist.ProcessGroup], device=None
) -> Tuple[int, int, int]:
    """(start, width, total) of this rank's vocabulary slice; one all-gather of one int64 on
    ``tp_group``; uneven shards allowed."""
    widths = all_gather_counts(
        local_width, tp_group, collective_device(tp_group) if device is None else device
    )
    r = group_rank(tp_group)
    return int(widths[:r].sum()), int(local_width), int(widths.sum())


class _VocabParallelEntropyLogProb(torch.autograd.Function):
    """(logits [B, S, V_r], target_ids, group, start, n_valid, chunk, T) -> (logprobs, entropy)
    [B, S] of softmax(logits / T); gradient through logprobs only."""

    @staticmethod
    def forward(ctx, logits, target_ids, tp_group, vocab_start, n_valid, chunk_size, T):
        B, S, _ = logits.shape
        n = B * S
        dtype = compute_dtype(logits)
        device = logits.device
        flat = flat_view(logits)

        local = target_ids.reshape(n) - vocab_start
        owned = (local >= 0) & (local < n_valid)
        local_idx = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(1)

        # Pass 1: local max per token; a shard with no valid column contributes -inf.
        m = torch.full((n,), float("-inf"), dtype=dtype, device=device)
        if n_valid > 0:
            for t0, t1 in token_chunks(n, chunk_size):
                block = token_block(logits, flat, t0, t1, n_valid).amax(dim=1).to(dtype)
                m[t0:t1] = at_temperature(block, T)  # max(z / T) = max(z) / T for T > 0
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)

        # Pass 2: the three partial sums against the global max, one SUM for all of them.
        stats = torch.zeros((3, n), dtype=dtype, device=device)
        if n_valid > 0:
            for t0, t1 in token_chunks(n, chunk_size):
                # may alias fp32 logits: no in-place ops on z
                z = at_temperature(token_block(logits, flat, t0, t1, n_valid).to(dtype), T)
                u = z - m[t0:t1].unsqueeze(1)
                u_target = u.gather(1, local_idx[t0:t1]).squeeze(1)  # before the floor: exact
                u.clamp_(min=_SHIFT_FLOOR)
                e = torch.exp(u)
                stats[0, t0:t1] = e.sum(dim=1)
                stats[1, t0:t1] = e.mul_(u).sum(dim=1)  # in place: no third [chunk, V/TP] buffer
                stats[2, t0:t1] = torch.where(owned[t0:t1], u_target, torch.zeros_like(u_target))
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)

        log_s = torch.log(stats[0])
        entropy = log_s - stats[1] / stats[0]
        logprobs = stats[2] - log_s
        lse = m + log_s
        check_reduced_finite(lse, entropy, S)
        ctx.save_for_backward(logits, local_idx, owned, lse)
        ctx.n_valid = n_valid
        ctx.chunk_size, ctx.temperature = chunk_size, T
        logprobs, entropy = logprobs.view(B, S), entropy.view(B, S)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_idx, owned, lse = ctx.saved_tensors
        if grad_logprobs is None or not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        B, S, V_r = logits.shape
        n = B * S
        n_valid = ctx.n_valid
        flat = flat_view(logits)
        T = ctx.temperature
        # d/dlogits = (1/T) d/dz with z = logits / T: the 1/T goes into the incoming gradient
        g_out = at_temperature(grad_logprobs.reshape(n).to(lse.dtype), T)
        g_target = torch.where(owned, g_out, torch.zeros_like(g_out)).unsqueeze(1)
        # Padding columns are outside the softmax: their gradient is exactly zero.
        alloc = torch.empty if n_valid == V_r else torch.zeros
        grad = alloc((n, V_r), dtype=logits.dtype, device=logits.device)
        if n_valid > 0:
            for t0, t1 in token_chunks(n, ctx.chunk_size):
                z = at_temperature(token_block(logits, flat, t0, t1, n_valid).to(lse.dtype), T)
                # onehot(y) - softmax(z), with softmax from the saved GLOBAL log-partition.
                gz = (z - lse[t0:t1].unsqueeze(1)).exp_().mul_(-g_out[t0:t1].unsqueeze(1))
                gz.scatter_add_(1, local_idx[t0:t1], g_target[t0:t1])
                grad[t0:t1, :n_valid] = gz.to(logits.dtype)
        return grad.view(B, S, V_r), None, None, None, None, None, None


def vocab_parallel_entropy_and_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    *,
    vocab_size: Optional[int] = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary entropy and log-prob of ``target_ids`` per position, from this TP rank's
    vocabulary shard.

    logits [B, S, V/TP] (any float dtype and strides); target_ids [B, S] global ids in
    [0, vocab_size), the same on all TP ranks; vocab_size: the real V when padded -> (entropy [B, S]
    f32 without grad, logprobs [B, S] f32 differentiable; fp64 in, fp64 out), identical on every TP
    rank. Position s is scored from the logits at s (the caller shifts).

    Collectives on ``tp_group``, forward only: one all-gather of one int64, one all-reduce MAX of N
    floats, one all-reduce SUM of 3 x N floats (N = B x S). Memory: a few ``chunk_size x V/TP`` fp32
    buffers; saves a reference to ``logits`` (do not modify it before backward). ``tp_group=None``
    or one rank: ``core.entropy.entropy_and_logprobs``. Of softmax(logits / ``temperature``),
    each chunk divided as it is read."""
    # An empty local shard is legal (padded or uneven vocab splits).
    check_logits_and_targets(logits, target_ids, chunk_size, vocab="V/TP", allow_empty_vocab=True)
    T = check_temperature(temperature)
    if vocab_size is not None and (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, numbers.Integral)
        or vocab_size < 1
    ):
        raise ValueError(
            f"vocab_size must be an int >= 1 (the unpadded vocabulary size), got {vocab_size!r}"
        )
    if is_single(tp_group):
        from nemo_d3s.core.entropy import entropy_and_logprobs

        V = logits.shape[2]
        if vocab_size is not None and vocab_size > V:
            raise ValueError(
                f"vocab_size ({vocab_size}) exceeds the logits' vocabulary dimension ({V})"
            )
        real = V if vocab_size is None else vocab_size
        return entropy_and_logprobs(
            logits[..., :real], target_ids, chunk_size=chunk_size, temperature=T
        )

    start, width, total = vocab_shard_range(logits.shape[2], tp_group, logits.device)
    if vocab_size is None:
        vocab_size = total
    elif vocab_size > total:
        raise ValueError(f"vocab_size ({vocab_size}) exceeds the sum of the shard widths ({total})")
    if target_ids.numel():
        lo, hi = int(target_ids.min()), int(target_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"target_ids must be in [0, {vocab_size}) (the vocabulary size), found {bad}"
            )
    n_valid = max(0, min(width, vocab_size - start))
    logprobs, entropy = _VocabParallelEntropyLogProb.apply(
        logits, target_ids.to(torch.long), tp_group, start, n_valid, int(chunk_size), T
    )
    return entropy, logprobs
