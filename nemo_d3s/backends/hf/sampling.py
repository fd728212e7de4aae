"""Decoding loops of the HF backend: ``decode_seeded`` (a private generator per (prompt seed,
sample index): layout-independent) and ``decode_hf_generate`` (one seed per call). Both take
left-padded prompts and return (responses up to and including the first stop token, finished).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, ContextManager, List, Optional, Sequence, Tuple, Union

import torch

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.hf.rollout import cut_at_eos, left_pad
from nemo_d3s.backends.hf.routing import RouterHooks, empty_routing

_MASK63 = (1 << 63) - 1


def row_seed(prompt_seed: int, sample: int) -> int:
    """One 63-bit generator seed from (prompt seed, sample index).

    The odd 64-bit multipliers (golden-ratio and splitmix constants) spread nearby prompt
    seeds and sample indices apart, so (s, j) and (s + 1, j - 1) do not collide.
    """
    return (
        (int(prompt_seed) * 0x9E3779B97F4A7C15) ^ (int(sample) * 0xBF58476D1CE4E5B9 + 1)
    ) & _MASK63


def prompt_seeds(seed: Union[int, Sequence[int]], n_prompts: int) -> List[int]:
    """An int s means seeds [s, s+1, ...]; a sequence must have one seed per prompt."""
    if isinstance(seed, int) or (isinstance(seed, torch.Tensor) and seed.dim() == 0):
        return [int(seed) + i for i in range(n_prompts)]
    seeds = [int(s) for s in seed]
    if len(seeds) != n_prompts:
        raise ValueError(f"seed has {len(seeds)} entries but there are {n_prompts} prompts")
    return seeds


def sample_next(
    logits: torch.Tensor, uniforms: torch.Tensor, cfg: GenerationConfig
) -> torch.Tensor:
    """logits [b, V] (last position), uniforms [b] in [0, 1) -> next ids [b] long.

    Inverse-CDF sampling with one uniform per row, so a row's token depends only on its own
    logits and its own uniform, never on the other rows. Temperature, then top-k, then
    top-p (the smallest prefix of the sorted distribution whose mass reaches top_p).
    """
    if not cfg.do_sample:
        return logits.argmax(dim=-1)
    return draw_tempered(tempered_logits(logits, cfg), uniforms, cfg)


def tempered_logits(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """logits [b, V] -> float32 [b, V] of the distribution sampled: divided by the
    temperature when sampling, as they are (greedy decoding: the raw logits)."""
    logits = logits.float()
    return logits / cfg.temperature if cfg.do_sample and cfg.temperature != 1.0 else logits


def draw_tempered(
    logits: torch.Tensor, uniforms: torch.Tensor, cfg: GenerationConfig
) -> torch.Tensor:
    """:func:`sample_next` of logits already tempered (:func:`tempered_logits`); ``logits``
    is not written to."""
    order = None
    if cfg.top_k > 0 or cfg.top_p < 1.0:
        # Stable sort: equal logits keep vocabulary order, so ties break by the lower id.
        logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        if 0 < cfg.top_k < logits.shape[-1]:
            logits[:, cfg.top_k :] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        # Mass strictly before each entry < top_p keeps it; the first entry always stays.
        probs = probs * ((probs.cumsum(dim=-1) - probs) < cfg.top_p)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    # right=True: the first index whose cumulative mass exceeds the target, which always has
    # non-zero probability (zero-mass entries do not raise the cdf).
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    if order is not None:
        idx = order.gather(-1, idx)
    return idx.squeeze(-1)


def kv_cache_name(model) -> str:
    """The KV-cache keyword: ``cache`` in transformers 5 (which warns on the old name,
    utils/generic.py ``_BCCacheNameMeta``), ``past_key_values`` in 4.x."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def decode_seeded(
    model,
    prompt_rows: List[List[int]],
    seeds: List[int],
    cfg: GenerationConfig,
    pad_id: int,
    eos_ids: Sequence[int],
    device: torch.device,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    check_stop: Callable[[], None] = lambda: None,
    logprobs: Optional[List[List[float]]] = None,
    routing: Optional[List[torch.Tensor]] = None,
) -> Tuple[List[List[int]], List[bool]]:
    """Decode b rows with a KV cache, row i drawing its uniforms from ``seeds[i]``;
    ``check_stop()`` runs before every token. Position ids count real tokens only, so a row
    sees the positions it would alone. ``logprobs``: a list that gets each row's sampled
    tokens' log-probs (log-softmax of the logits divided by the temperature when sampling, as
    the trainer scores them: ``PolicySettings.logit_temperature``).
    ``routing`` (a mixture of experts): a list that gets each row's routing [p_i + n_i, L, K]
    int16 over its prompt and response tokens (``backends/hf/routing.py``): the experts of
    every token the sampler fed, ``NO_EXPERT`` for a last token it never fed back. Memory:
    the KV cache [layers, b, kv_heads, P + T, head_dim], one [b, V] logits row and (routing)
    [b, P + T, L, K] int16.
    """
    T, b = cfg.max_new_tokens, len(prompt_rows)
    if T > 0:
        uniforms = torch.stack(
            [
                torch.rand(T, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                for s in seeds
            ]
        )
    else:
        uniforms = torch.zeros(b, 0, dtype=torch.float64)
    ids, mask = left_pad(prompt_rows, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    eos = torch.tensor(list(eos_ids), device=device)
    out = torch.full((b, T), pad_id, dtype=torch.long, device=device)
    lp = torch.zeros((b, T), dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    past, step_ids = None, ids
    cache_kw = kv_cache_name(model)
    hooks = RouterHooks(model) if routing is not None else None
    hooks = hooks if hooks is not None and hooks.is_moe else None  # a dense model: no routers
    for t in range(T):
        check_stop()
        position_ids = (mask.cumsum(dim=-1) - 1).clamp_(min=0)[:, -step_ids.shape[1] :]
        recording = hooks.record(*step_ids.shape) if hooks else contextlib.nullcontext()
        with autocast(), recording:
            res = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{cache_kw: past},
            )
        past = getattr(res, cache_kw)
        # divided by the temperature once: the draw and its log-prob read the same [b, V]
        tempered = tempered_logits(res.logits[:, -1, :], cfg)
        nxt = draw_tempered(tempered, uniforms[:, t], cfg) if cfg.do_sample else tempered.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out[:, t] = nxt
        if logprobs is not None:
            # of the distribution sampled (at the temperature), as the trainer scores it
            lp[:, t] = torch.log_softmax(tempered, dim=-1).gather(1, nxt[:, None])[:, 0]
        lengths += (~done).long()
        done = done | torch.isin(nxt, eos)
        if bool(done.all()):
            break
        step_ids = nxt.unsqueeze(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    out, n, finished = out.cpu(), lengths.cpu().tolist(), done.cpu().tolist()
    if routing is not None:
        routing += _row_routing(hooks, prompt_rows, n, ids.shape[1])
    if logprobs is not None:
        lp = lp.cpu()
        logprobs += [lp[i, : n[i]].tolist() for i in range(b)]
    return [out[i, : n[i]].tolist() for i in range(b)], finished


def _row_routing(
    hooks: Optional[RouterHooks], prompt_rows: List[List[int]], n: List[int], P: int
) -> List[Optional[torch.Tensor]]:
    """Each row's routing [p_i + n_i, L, K] int16 from the decode's records: the prefill's
    [b, P, L, K] (prompts left-padded to P), then one [b, 1, L, K] per fed token (call j
    feeds response token j - 1); None per row for a dense model."""
    if hooks is None or not hooks.recorded:
        return [None] * len(prompt_rows)
    rec = torch.cat(hooks.recorded, dim=1).cpu()
    fed = rec.shape[1] - P  # response tokens fed back
    rows = []
    for i, prompt in enumerate(prompt_rows):
        p, m = len(prompt), min(n[i], fed)
        row = empty_routing(1, p + n[i], rec.shape[2], rec.shape[3])[0]
        row[:p] = rec[i, P - p : P]
        row[p : p + m] = rec[i, P : P + m]
        rows.append(row)
    return rows


@torch.no_grad()
def decode_hf_generate(
    model,
    prompt_rows: List[List[int]],
    seed: int,
    cfg: GenerationConfig,
    pad_id: int,
    eos_ids: Sequence[int],
    device: torch.device,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Tuple[List[List[int]], List[bool]]:
    """``model.generate`` on the left-padded rows under ``torch.manual_seed(seed)`` inside a
    forked RNG (the caller's global RNG state is untouched)."""
    from transformers import GenerationConfig as HFGenerationConfig

    sampling = (
        dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k) if cfg.do_sample else {}
    )
    gen_cfg = HFGenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=cfg.do_sample,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
        **sampling,
    )
    ids, mask = left_pad(prompt_rows, pad_id)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(int(seed))
        with autocast():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg
            )
    responses, finished = [], []
    for row in out[:, ids.shape[1] :].tolist():
        resp, done = cut_at_eos(row, eos_ids)
        responses.append(resp)
        finished.append(done)
    return responses, finished
