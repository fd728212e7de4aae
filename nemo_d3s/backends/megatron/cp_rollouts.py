"""Rollouts under context parallelism: the CP ranks of a model copy share its prompts.

A model copy at CP > 1 is CP model-parallel (TP x PP) groups holding the same weights (CP
shards the sequence, never the weights), each with its own engine (``engine.place_engine``).
Each group generates a contiguous block of the DP rank's prompts (block c of CP: prompts
[len*c/CP, len*(c+1)/CP)), the CP ranks wait for each other on the job's store (a long
generation is not one collective's timeout: ``distributed/generation_wait.py``), then one
``all_gather_object`` over the CP group's gloo twin gives every CP rank the whole DP share,
in prompt order. With per-prompt seeds (``prompt_seeds``) the rollouts are the ones one engine
would sample for all the prompts, so CP 2 samples what CP 1 samples; the engines' GPUs, all
of them busy, generate CP times fewer rows each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_d3s.backends.base import (
    GenerationConfig,
    GenerationInterrupted,
    RolloutEngine,
    Rollouts,
)
from nemo_d3s.backends.engine_wait import agreed_generation
from nemo_d3s.backends.wrappers import EngineWrapper, concat_rollouts
from nemo_d3s.distributed.generation_wait import GenerationWait, generation_limit_s

__all__ = ["ContextParallelRollouts", "join_blocks", "prompt_blocks"]


def prompt_blocks(n_prompts: int, cp: int) -> List[range]:
    """The prompts of each CP rank: ``cp`` contiguous blocks, sizes differing by at most one
    (the first blocks the smaller); a rank past the prompts gets an empty block."""
    bounds = [n_prompts * c // cp for c in range(cp + 1)]
    return [range(bounds[c], bounds[c + 1]) for c in range(cp)]


class ContextParallelRollouts(EngineWrapper):
    """``inner`` (this CP rank's model-parallel engine) generating this CP rank's block of the
    prompts; every CP rank of ``group`` returns all of them. Everything else is ``inner``'s:
    refits (each group refits its own engine from its own, identical, weights), release,
    pinning, liveness."""

    def __init__(self, inner: RolloutEngine, group: Any, pad_id: int) -> None:
        """``group``: the CP group's gloo twin (``parallel.context_parallel_gloo_group``)."""
        super().__init__(inner)
        self.group, self.pad_id = group, int(pad_id)
        self.cp, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)
        first = dist.get_global_rank(group, 0)
        self.wait = GenerationWait.of_group(f"cp{first}", group)

    # what an engine says of itself is the inner engine's
    prompt_seeds = property(lambda self: self.inner.prompt_seeds)
    on_policy = property(lambda self: self.inner.on_policy)

    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        blocks = prompt_blocks(len(prompts), self.cp)
        mine = blocks[self.cp_rank]
        call = None
        if len(mine):  # the same on every rank of this model-parallel group (one CP rank)

            def call() -> Rollouts:
                sub = [prompts[i] for i in mine]
                return self.inner.generate(sub, n_samples, cfg, [seeds[i] for i in mine])

        rows = max(len(b) for b in blocks) * n_samples
        limit = generation_limit_s(self.wait.base_s, rows, cfg.max_new_tokens)
        out, outcome = agreed_generation(self.wait, self.alive, call, stopping=False, limit_s=limit)
        if outcome.interrupted:  # every CP rank stops with the one cut short
            raise GenerationInterrupted("stop requested during generation (on a CP rank)")
        parts: List[Optional[Rollouts]] = [None] * self.cp
        dist.all_gather_object(parts, out, group=self.group)
        return join_blocks(parts, blocks, self.pad_id)

    def __getattr__(self, name: str) -> Any:  # what the trainer asks of particular engines
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def join_blocks(
    parts: Sequence[Optional[Rollouts]], blocks: Sequence[range], pad_id: int
) -> Rollouts:
    """The CP ranks' Rollouts (None for an empty block) as one, in prompt order: rows
    re-padded to the longest, ``prompt_index`` into the whole prompt list."""
    kept = [(p, b) for p, b in zip(parts, blocks) if len(b)]
    if any(p is None for p, _ in kept):
        raise RuntimeError("a CP rank with prompts returned no rollouts")
    joined = concat_rollouts([p for p, _ in kept], pad_id)
    index = torch.cat([p.prompt_index + b.start for p, b in kept])
    return dataclasses.replace(joined, prompt_index=index)
