"""The HF backend's micro-batched forward: the rows (or packs) of a scoring or update pass and
each one's token log-probs and entropy at the scoring temperature, with the MoE routers'
choices recorded or replayed (``backends/hf/routing.py``)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_d3s.backends.base import TokenBatch
from nemo_d3s.backends.hf.packed import pack_batch, packed_logprobs
from nemo_d3s.backends.hf.rollout import real_length
from nemo_d3s.backends.hf.routing import RouterHooks, unpack_routing
from nemo_d3s.core.entropy import entropy_and_logprobs
from nemo_d3s.core.micro_batches import plan_rows, row_lengths
from nemo_d3s.core.routing import NO_EXPERT

__all__ = ["micro_batch_forward", "plan_micro_batches", "token_logprobs"]


def plan_micro_batches(
    batch: TokenBatch, micro_batch_size: int, micro_batch_tokens: int
) -> List[torch.Tensor]:
    """Row index tensors of the micro-batches (``core.micro_batches.plan_rows``)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return plan_rows(row_lengths(batch.attention_mask), micro_batch_size, micro_batch_tokens)


def token_logprobs(
    model,
    ids: torch.Tensor,
    attn: torch.Tensor,
    resp: torch.Tensor,
    with_entropy: bool,
    *,
    autocast: Callable[[], ContextManager],
    temperature: float,
):
    """(logprobs, entropy or None) [b, L] f32, token-aligned, 0 where attn is False.

    ids, attn on device; resp on the CPU (read without a device sync). Only positions
    from the first response token on are scored (``logits_to_keep``), so the memory is
    [b, L - first + 1, V] logits, not the prompt's.
    """
    L = ids.shape[1]
    has_resp = resp.any(dim=0)
    first = max(int(has_resp.int().argmax()), 1) if bool(has_resp.any()) else 1
    with autocast():
        logits = model(
            input_ids=ids,
            attention_mask=attn.long(),
            use_cache=False,
            logits_to_keep=L - first + 1,
        ).logits
    ent, lp = entropy_and_logprobs(logits[:, :-1], ids[:, first:], temperature=temperature)
    pad = (first, 0)
    lp = F.pad(lp.float(), pad) * attn
    ent = F.pad(ent.float(), pad) * attn if with_entropy else None
    return lp, ent


def micro_batch_forward(
    model,
    batch: TokenBatch,
    micro_batch_size: int,
    micro_batch_tokens: int,
    with_entropy: bool,
    *,
    device: torch.device,
    autocast: Callable[[], ContextManager],
    temperature: float,
    pack: bool,
    skip_unscored: bool,
    hooks: Optional[RouterHooks] = None,
) -> Iterator[
    Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int, Optional[torch.Tensor]]
]:
    """(rows, logprobs [n, W], entropy [n, W] or None, positions fed, routing) per
    micro-batch, W <= S: packs (``pack``), else rows cut to their longest (``skip_unscored``:
    none shorter than 2); routing [n, W, L, K]: the routers' own choice for the rows' real
    tokens (``NO_EXPERT`` elsewhere) when ``hooks`` are given, else None. A batch carrying
    ``routed_experts`` is routed by them (``hooks`` required)."""
    replay = batch.routed_experts
    if replay is not None and hooks is None:
        raise ValueError("a batch with routed_experts needs the router hooks")
    if pack:
        for p in pack_batch(batch, micro_batch_size, micro_batch_tokens):
            target = None if replay is None else p.pack(replay, NO_EXPERT).unsqueeze(0)
            with hooks.forward(1, p.width, target) if hooks else contextlib.nullcontext():
                lp, ent = packed_logprobs(
                    model, batch, p, device, with_entropy, autocast, temperature
                )
            routing = unpack_routing(p, hooks.pop()[1][0], lp.shape[1]) if hooks else None
            yield p.rows, lp, ent, p.width, routing
        return
    for rows in plan_micro_batches(batch, micro_batch_size, micro_batch_tokens):
        mb = batch.select(rows)
        L = real_length(mb.attention_mask)
        if L < 2 and skip_unscored:
            continue  # nothing to score: position 0 is 0 by contract
        L = max(L, 1)
        ids, attn = mb.input_ids[:, :L].to(device), mb.attention_mask[:, :L].to(device)
        target = None if replay is None else mb.routed_experts[:, :L]
        with hooks.forward(*ids.shape, target) if hooks else contextlib.nullcontext():
            lp, ent = token_logprobs(
                model,
                ids,
                attn,
                mb.response_mask[:, :L],
                with_entropy,
                autocast=autocast,
                temperature=temperature,
            )
        routing = None
        if hooks:  # padding was routed too: NO_EXPERT there
            routing = hooks.pop()[1].cpu()
            routing[~mb.attention_mask[:, :L]] = NO_EXPERT
        yield rows, lp, ent, len(rows) * L, routing
