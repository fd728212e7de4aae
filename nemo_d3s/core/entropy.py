"""Per-token entropy and log-probabilities from full-vocabulary logits [B, S, V]: the single-process
reference that ``nemo_d3s.distributed``'s vocab-sharded version is tested against.

With m = max z, e = exp(z - m), s = sum e: log p(y) = (z_y - m) - log s and H = log s - sum e
(z - m) / s (no cancellation under a large common logit offset). -inf logits get probability 0; NaN,
+inf or an all -inf row is an error. Work runs in fp32 (fp64 for fp64 logits) chunks of
``chunk_size`` tokens (extra memory a few chunk x V buffers, logits never copied whole); the
backward (onehot(y) - softmax) recomputes the softmax per chunk from the saved lse [B, S]."""

from __future__ import annotations

import math
import numbers
from typing import Iterator, Optional, Tuple

import torch

from nemo_d3s.core.checks import check_same_device, check_shape

__all__ = ["entropy_and_logprobs", "align_to_tokens", "check_temperature", "at_temperature"]


def flat_view(logits: torch.Tensor) -> Optional[torch.Tensor]:
    """[B, S, V] -> [B*S, V] view when the strides allow it, else None (no copy)."""
    B, S, V = logits.shape
    try:
        return logits.view(B * S, V)
    except RuntimeError:  # e.g. logits[:, :-1] of a contiguous [B, S+1, V], or a transposed buffer
        return None


def token_chunks(n_tokens: int, chunk_size: int) -> Iterator[Tuple[int, int]]:
    """[t0, t1) ranges of at most ``chunk_size`` flattened tokens covering [0, n_tokens)."""
    for t0 in range(0, n_tokens, chunk_size):
        yield t0, min(t0 + chunk_size, n_tokens)


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 logits; fp64 logits stay fp64 (exact gradient checks)."""
    return torch.promote_types(logits.dtype, torch.float32)


def token_block(
    logits: torch.Tensor,
    flat: Optional[torch.Tensor],
    t0: int,
    t1: int,
    width: Optional[int] = None,
) -> torch.Tensor:
    """Flattened tokens [t0, t1), vocabulary columns [0, width) (all when None) of logits [B, S, V]
    -> [t1 - t0, width]: a view via ``flat`` when it exists, else a copy of the block. Callers never
    modify it in place."""
    cols = slice(None) if width is None else slice(0, width)
    if flat is not None:
        return flat[t0:t1, cols]
    S = logits.shape[1]
    pieces, t = [], t0
    while t < t1:
        b, s = divmod(t, S)
        s_end = min(S, s + (t1 - t))
        pieces.append(logits[b, s:s_end, cols])
        t += s_end - s
    return torch.cat(pieces)


def check_logits_and_targets(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    chunk_size: int,
    *,
    vocab: str = "V",
    allow_empty_vocab: bool = False,
) -> None:
    """ValueError naming the argument unless logits is a floating-point [B, S, V] tensor (V > 0
    unless ``allow_empty_vocab``), target_ids an integer [B, S] on its device and chunk_size an int
    >= 1. Target ranges are the caller's to check."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 3-D tensor [B, S, {vocab}], got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if not allow_empty_vocab and logits.shape[2] == 0:
        raise ValueError(f"logits has an empty vocabulary dimension: shape {tuple(logits.shape)}")
    if (
        not isinstance(target_ids, torch.Tensor)
        or target_ids.is_floating_point()
        or target_ids.is_complex()
        or target_ids.dtype == torch.bool
    ):
        got = (
            target_ids.dtype if isinstance(target_ids, torch.Tensor) else type(target_ids).__name__
        )
        raise ValueError(f"target_ids must be an integer tensor [B, S], got {got}")
    check_shape("target_ids", target_ids, logits.shape[:2], "logits[..., 0]")
    check_same_device(logits=logits, target_ids=target_ids)
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, numbers.Integral)
        or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float; ValueError unless it is a finite number > 0."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def at_temperature(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / T as a new tensor (``z`` itself at T = 1: bit for bit the untempered path)."""
    return z if temperature == 1.0 else z / temperature


def check_reduced_finite(lse: torch.Tensor, entropy: torch.Tensor, S: int) -> None:
    """Raise naming the first position whose lse or entropy [B*S] is not finite (one host sync). TP
    ranks hold identical reduced values, so all raise together."""
    ok = torch.isfinite(lse) & torch.isfinite(entropy)
    if lse.numel() and not bool(ok.all()):
        bad = int((~ok).nonzero()[0, 0])
        raise ValueError(
            "logits must be finite or -inf with at least one finite entry per position; "
            f"position (b={bad // S}, s={bad % S}) has NaN, +inf or only -inf"
        )


def _lse_entropy(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z [n, V] -> (row max m, log s, entropy) [n], with lse = m + log s kept apart: adding them
    first would round log p at the offset's magnitude (4.8e-4 at 1e4 in fp32). Two [n, V]
    buffers."""
    m = z.amax(dim=1, keepdim=True)
    u = z - m  # <= 0; -inf for masked vocabulary entries
    e = torch.exp(u)
    s = e.sum(dim=1)
    # A probability-0 entry contributes 0 to the entropy, but 0 x (-inf) is NaN: make u
    # finite first (e is exactly 0 wherever u was -inf, so the product stays 0).
    u.clamp_(min=torch.finfo(u.dtype).min)
    eu_sum = e.mul_(u).sum(dim=1)
    log_s = torch.log(s)
    entropy = log_s - eu_sum / s
    return m.squeeze(1), log_s, entropy


class _EntropyLogProb(torch.autograd.Function):
    """(logits [B, S, V], target_ids [B, S], chunk_size, T) -> (logprobs, entropy) [B, S] of
    softmax(logits / T); gradient flows through logprobs only."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_ids: torch.Tensor, chunk_size: int, T: float):
        B, S, V = logits.shape
        n = B * S
        flat = flat_view(logits)
        targets = target_ids.reshape(n)
        dtype = compute_dtype(logits)
        row_max = torch.empty(n, dtype=dtype, device=logits.device)
        log_s = torch.empty(n, dtype=dtype, device=logits.device)
        entropy = torch.empty(n, dtype=dtype, device=logits.device)
        logprobs = torch.empty(n, dtype=dtype, device=logits.device)
        for t0, t1 in token_chunks(n, chunk_size):
            # may alias fp32 logits: no in-place ops
            z = at_temperature(token_block(logits, flat, t0, t1).to(dtype), T)
            m_c, log_s_c, ent_c = _lse_entropy(z)
            row_max[t0:t1], log_s[t0:t1], entropy[t0:t1] = m_c, log_s_c, ent_c
            logprobs[t0:t1] = (z.gather(1, targets[t0:t1].unsqueeze(1)).squeeze(1) - m_c) - log_s_c
        # One host sync for the whole call rather than one per chunk.
        check_reduced_finite(row_max + log_s, entropy, S)
        ctx.save_for_backward(logits, targets, row_max, log_s)
        ctx.chunk_size, ctx.temperature = chunk_size, T
        logprobs, entropy = logprobs.view(B, S), entropy.view(B, S)
        # Must mark the tensor objects actually returned (the views), not their bases.
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        logits, targets, row_max, log_s = ctx.saved_tensors
        if grad_logprobs is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        B, S, V = logits.shape
        n = B * S
        flat = flat_view(logits)
        T = ctx.temperature
        # d/dlogits = (1/T) d/dz with z = logits / T: the 1/T goes into the incoming gradient
        g_out = at_temperature(grad_logprobs.reshape(n).to(log_s.dtype), T)
        grad = torch.empty((n, V), dtype=logits.dtype, device=logits.device)
        for t0, t1 in token_chunks(n, ctx.chunk_size):
            z = at_temperature(token_block(logits, flat, t0, t1).to(log_s.dtype), T)
            g = g_out[t0:t1].unsqueeze(1)
            # d log p(y) / dz = onehot(y) - softmax(z); softmax recomputed from the saved row
            # max and log s, offset-free like the forward.
            gz = torch.exp((z - row_max[t0:t1].unsqueeze(1)) - log_s[t0:t1].unsqueeze(1)) * (-g)
            gz.scatter_add_(1, targets[t0:t1].unsqueeze(1), g)
            grad[t0:t1] = gz.to(logits.dtype)
        return grad.view(B, S, V), None, None, None


def entropy_and_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [B, S, V] (any float dtype, any strides), target_ids [B, S] in
    [0, V) -> (entropy [B, S] f32 without grad, logprobs [B, S] f32 differentiable); fp64 in, fp64
    out. Of softmax(logits / ``temperature``): the distribution a sampler at that temperature
    draws from (each chunk divided as it is read: no tempered copy of the logits).

    Position s is scored from the logits at s: the caller shifts, then :func:`align_to_tokens`.
    Saves lse [B, S] and a reference to ``logits`` (do not modify it before backward). No
    collectives."""
    check_logits_and_targets(logits, target_ids, chunk_size)
    T = check_temperature(temperature)
    B, S, V = logits.shape
    if target_ids.numel():
        lo, hi = int(target_ids.min()), int(target_ids.max())
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise ValueError(f"target_ids must be in [0, {V}) (the vocabulary size V), found {bad}")
    logprobs, entropy = _EntropyLogProb.apply(logits, target_ids.to(torch.long), int(chunk_size), T)
    return entropy, logprobs


def align_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [B, S-1] (entry s about token s + 1) -> [B, S] with out[:, 0] = 0 and out[:, t] =
    x[:, t - 1]; differentiable."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D tensor [B, S-1], got {shape}")
    return torch.nn.functional.pad(x, (1, 0))
