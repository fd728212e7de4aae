"""Packed rows on the HF backend: one [1, T] row of several rows (``core.packing``), fed
with position ids restarting per row and no mask. transformers 5 reads those as packed
sequences (masking_utils.py:735-764 and 862-870 of 5.24: a block-diagonal mask for sdpa /
eager, varlen for flash attention); Llama, Qwen2 and Qwen3 pass them to the mask and RoPE."""

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
    """Packs of ``micro_batch_tokens`` positions, or (0) ``micro_batch_size`` longest rows'."""
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
    temperature: float = 1.0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(logprobs, entropy or None) [n, S] f32 of a pack's rows, token-aligned, from each
    row's first response token on (0 elsewhere); the LM head runs at those K positions
    only (``logits_to_keep``): [K, V] logits."""
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
    ent, lp = entropy_and_logprobs(logits, ids[p.to(device)].unsqueeze(0), temperature=temperature)
    n = len(pack.rows)
    rc = (r.to(device), c.to(device))
    logprobs = torch.zeros(n, S, device=device).index_put(rc, lp[0].float())
    entropy = None
    if with_entropy:
        entropy = torch.zeros(n, S, device=device).index_put(rc, ent[0].float())
    return logprobs, entropy
