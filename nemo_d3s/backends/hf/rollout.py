"""Token layout helpers for generation: prompts are sampled LEFT-padded (so every row's
next token sits in the same column) and handed to the trainer RIGHT-padded (so position t
of every row is token t of that sequence and masks are simple prefixes/ranges)."""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import torch

from nemo_d3s.backends.base import TokenBatch


def encode_prompts(
    tokenizer, prompts: Sequence[str], use_chat_template: bool = True
) -> List[List[int]]:
    """Token ids of each prompt, as a single user turn followed by the assistant header when
    the tokenizer has a chat template (and ``use_chat_template``), else the raw text."""
    out = []
    templated = use_chat_template and getattr(tokenizer, "chat_template", None)
    for text in prompts:
        if templated:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            # The template already wrote BOS/turn markers; adding them again would double them.
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if len(ids) == 0:
            raise ValueError(f"prompt {text!r} encodes to zero tokens")
        out.append(list(ids))
    return out


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """[n] ragged id lists -> (ids [n, P] long, attention_mask [n, P] long), padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def cut_at_eos(generated: Sequence[int], eos_ids: Iterable[int]) -> Tuple[List[int], bool]:
    """Response tokens up to and including the first EOS, and whether an EOS was found.

    ``generate`` keeps emitting pad (often == EOS) for rows that finished early, so
    everything after the first EOS is filler, never part of the response.
    """
    eos = set(eos_ids)
    for i, tok in enumerate(generated):
        if tok in eos:
            return list(generated[: i + 1]), True
    return list(generated), False


def right_padded_batch(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int
) -> TokenBatch:
    """Concatenate each row's prompt and response and right-pad to S = the longest row.

    input_ids [B, S] long; attention_mask [B, S] bool (prompt + response);
    response_mask [B, S] bool (response tokens only, EOS included).
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            f"prompt_ids has {len(prompt_ids)} rows but response_ids has {len(response_ids)}"
        )
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths, default=0)
    n = len(lengths)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.bool)
    resp = torch.zeros((n, width), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        row = list(p) + list(r)
        if row:
            ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        attn[i, : len(row)] = True
        resp[i, len(p) : len(row)] = True
    return TokenBatch(ids, attn, resp)


def token_aligned(
    prompt_ids: Sequence[Sequence[int]], values: Sequence[Sequence[float]], width: int
) -> torch.Tensor:
    """[B, width] f32: row i's response values at the positions of its response tokens (after
    its prompt), 0 elsewhere: the layout of ``right_padded_batch``."""
    out = torch.zeros((len(prompt_ids), width), dtype=torch.float32)
    for i, (p, v) in enumerate(zip(prompt_ids, values)):
        out[i, len(p) : len(p) + len(v)] = torch.tensor(list(v), dtype=torch.float32)
    return out


def real_length(attention_mask: torch.Tensor) -> int:
    """1 + the last column holding a real token in any row of a right-padded [b, S] mask
    (0 when empty): columns after it only carry padding and can be skipped."""
    cols = attention_mask.any(dim=0).nonzero()
    return int(cols[-1].item()) + 1 if cols.numel() else 0


def stop_token_ids(tokenizer, generation_config, stop_tokens: Iterable[str]) -> List[int]:
    """Token ids that end a response: the tokenizer's EOS, the generation config's EOS
    id(s) and each of ``stop_tokens`` that the tokenizer has as one token."""
    ids = {int(tokenizer.eos_token_id)}
    gen_eos = (
        getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    )
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[tok] for tok in stop_tokens if tok in vocab)
    return sorted(ids)
