"""Rollout-engine wrappers for engines that cannot honour one seed per prompt.

The trainer always calls ``engine.generate(prompts, n, cfg, seeds)`` with one seed per
prompt and relies on a prompt's samples depending only on (prompt, seed, weights), which
makes a data-parallel run sample what a one-process run samples. An engine that takes one
seed per CALL (``prompt_seeds = False``, e.g. the HF backend's ``model.generate`` sampler)
is wrapped once, at build time:

- :class:`PerPromptCalls`: one call per prompt with that prompt's seed (keeps the
  guarantee; slower on CPU, where one decode step of 8 or 64 rows costs about the same);
- :class:`OneSeedPerCall`: one batched call seeded by the first prompt's seed (faster,
  reproducible and resumable, but the samples depend on the batch layout).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from nemo_d3s.backends.base import GenerationConfig, Policy, RolloutEngine, Rollouts, TokenBatch
from nemo_d3s.core.routing import NO_EXPERT

__all__ = [
    "EngineWrapper",
    "OneSeedPerCall",
    "PerPromptCalls",
    "concat_rollouts",
    "pad_columns",
    "pad_token_id",
]


def pad_columns(t: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    """[B, S, ...] -> [B, length, ...] (length >= S): ``value`` in the new columns."""
    if t.shape[1] == length:
        return t
    pad = t.new_full((t.shape[0], length - t.shape[1], *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def joined_stats(parts: Sequence[tuple]) -> Dict[str, float]:
    """The engine stats of parts generated apart, as one call's: counts and seconds add up,
    a ``*_mean`` or ``*_frac`` is weighted by each part's rows, ``gen_tokens_per_s`` is the
    joined tokens over the joined seconds. ``parts``: (rows, stats) pairs."""
    rows = sum(n for n, _ in parts) or 1
    out: Dict[str, float] = {}
    for n, stats in parts:
        for k, v in stats.items():
            share = n / rows if k.endswith(("_mean", "_frac")) else 1.0
            out[k] = out.get(k, 0.0) + share * float(v)
    if "gen_tokens_per_s" in out:
        out["gen_tokens_per_s"] = out.get("gen_tokens", 0.0) / max(
            out.get("gen_seconds", 0.0), 1e-9
        )
    return out


def concat_rollouts(parts: Sequence[Rollouts], pad_id: int) -> Rollouts:
    """Stack per-prompt Rollouts (each right-padded to its own S) into one, right-padded
    to the longest; ``prompt_index`` is renumbered to the position of the part."""
    length = max(p.batch.input_ids.shape[1] for p in parts)
    batch = TokenBatch(
        input_ids=torch.cat([pad_columns(p.batch.input_ids, length, pad_id) for p in parts]),
        attention_mask=torch.cat(
            [pad_columns(p.batch.attention_mask, length, False) for p in parts]
        ),
        response_mask=torch.cat([pad_columns(p.batch.response_mask, length, False) for p in parts]),
    )
    prompt_index = torch.cat(
        [torch.full((len(p.batch),), i, dtype=torch.long) for i, p in enumerate(parts)]
    )
    stats = joined_stats([(len(p.batch), p.stats) for p in parts])
    sampling = routed = None
    if all(p.sampling_logprobs is not None for p in parts):
        sampling = torch.cat([pad_columns(p.sampling_logprobs, length, 0.0) for p in parts])
    if all(p.routed_experts is not None for p in parts):
        routed = torch.cat([pad_columns(p.routed_experts, length, NO_EXPERT) for p in parts])
    return Rollouts(
        batch=batch,
        prompt_index=prompt_index,
        response_texts=[t for p in parts for t in p.response_texts],
        finished=torch.cat([p.finished for p in parts]),
        stats=stats,
        sampling_logprobs=sampling,
        routed_experts=routed,
    )


def pad_token_id(tokenizer: Any) -> int:
    """The id rows are right-padded with: the tokenizer's pad id, else its EOS id, else 0
    (padding is always masked out)."""
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return 0


class EngineWrapper(RolloutEngine):
    """A rollout engine around another: all but ``generate`` is the inner engine's."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer

    @property
    def should_stop(self):
        return self.inner.should_stop

    @should_stop.setter
    def should_stop(self, fn) -> None:
        self.inner.should_stop = fn

    def sync_weights(self, policy: Policy) -> None:
        self.inner.sync_weights(policy)

    @property
    def own_weights(self) -> bool:
        return self.inner.own_weights

    def release(self) -> None:
        self.inner.release()

    def pin_weights(self) -> None:
        self.refit_on_generate = False
        self.inner.pin_weights()

    def held_weights(self):
        return self.inner.held_weights()

    def alive(self) -> bool:
        return self.inner.alive()

    @property
    def stopped(self) -> bool:
        return self.inner.stopped


class PerPromptCalls(EngineWrapper):
    """One ``inner.generate`` call per prompt, seeded with that prompt's seed."""

    prompt_seeds = True

    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        if len(seeds) != len(prompts):
            raise ValueError(
                f"{len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt"
            )
        parts = [self.inner.generate([p], n_samples, cfg, int(s)) for p, s in zip(prompts, seeds)]
        for i, part in enumerate(parts):
            if len(part.batch) != n_samples:
                raise RuntimeError(
                    f"the rollout engine returned {len(part.batch)} rows for prompt {i}, "
                    f"expected {n_samples}"
                )
        return concat_rollouts(parts, pad_token_id(self.tokenizer))


class OneSeedPerCall(EngineWrapper):
    """One batched ``inner.generate`` call seeded by the first prompt's seed (the samples
    then depend on which prompts share the call: not layout-independent)."""

    prompt_seeds = False

    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        if len(seeds) != len(prompts):
            raise ValueError(
                f"{len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt"
            )
        return self.inner.generate(prompts, n_samples, cfg, int(seeds[0]))
