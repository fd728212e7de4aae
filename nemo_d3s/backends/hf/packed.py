"""Packed sequences on the HF backend: a micro-batch is one [1, T] row of several rows'
tokens (``core.packing``), fed with ``position_ids`` that restart at every row and no
attention mask.

transformers 5 turns such position ids into per-row attention: ``masking_utils.
find_packed_sequence_indices`` (transformers 5.24 masking_utils.py:735-764) reads a new row
wherever a position is not its predecessor + 1, and ``create_causal_mask`` /
``create_sliding_window_causal_mask`` (lines 862-870, 991-1002, 1225-1236) AND that
block-diagonal mask into the causal one when ``attention_mask`` is None and there is no
cache; Llama, Qwen2 and Qwen3 pass their position ids there and to RoPE. The flash-attention
implementations read the same position ids as varlen boundaries. On CPU (sdpa / eager) the
mask is a dense [T, T] one: no saving in attention, only in the rest of the model.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, List, Optional, Tuple

import torch

from nemo_d3s.backends.base import TokenBatch
from nemo_d3s.core.entropy import entropy_and_logprobs
from nemo_d3s.core.micro_batches import row_lengths
from nemo_d3s.core.packing import PackedMicroBatch, pack_micro_batches

__all__ = ["VARLEN_ATTENTION", "pack_batch", "packed_logprobs"]

# attn_implementation values whose kernels take packed rows as varlen (no [T, T] mask)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


def pack_batch(
    batch: TokenBatch, micro_batch_size: int, micro_batch_tokens: int
) -> List[PackedMicroBatch]:
    """The packs of ``batch``: ``micro_batch_tokens`` positions each, or (0) as many as
    ``micro_batch_size`` rows of the batch's longest row take."""
    lengths = row_lengths(batch.attention_mask)
    longest = int(lengths.max()) if lengths.numel() else 1
    budget = micro_batch_tokens or micro_batch_size * max(longest, 1)
    return pack_micro_batches(lengths, budget)


def packed_logprobs(
    model,
    batch: TokenBatch,
    pack: PackedMicroBatch,
    device,
    with_entropy: bool,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One pack through ``model`` -> (logprobs [n, S] f32, entropy [n, S] f32 or None) of its
    rows, token-aligned, differentiable when grad is on. Scored: each row's tokens from its
    first response token (column >= 1) on; the rest holds 0. The LM head runs only at the
    scored positions' predecessors (``logits_to_keep``). Memory: [K, V] logits, K = scored
    tokens."""
    S = batch.input_ids.shape[1]
    resp = batch.response_mask[pack.rows]
    first = torch.where(resp.any(1), resp.int().argmax(1), S).clamp(min=1)
    r, c, p = pack.tokens(first)
    ids = pack.pack(batch.input_ids).to(device)
    with autocast():
        logits = model(
            input_ids=ids.unsqueeze(0),
            position_ids=pack.position_ids().to(device).unsqueeze(0),
            use_cache=False,
            logits_to_keep=(p - 1).to(device),
        ).logits
    ent, lp = entropy_and_logprobs(logits, ids[p.to(device)].unsqueeze(0))
    n = len(pack.rows)
    rc = (r.to(device), c.to(device))
    logprobs = torch.zeros(n, S, device=device).index_put(rc, lp[0].float())
    entropy = None
    if with_entropy:
        entropy = torch.zeros(n, S, device=device).index_put(rc, ent[0].float())
    return logprobs, entropy
