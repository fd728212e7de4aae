"""Prompts for each step, layout-independent seeds, and batching of per-prompt rollouts.

Reproducibility and data parallelism rest on two rules:

1. The global prompt list of step ``s`` is a pure function of (seed, s): every rank draws
   the same list and keeps its contiguous slice, so the union over ranks is the
   one-process batch and a resumed run sees the same data order without saving a sampler.
2. The generation seed of a prompt is a pure function of (seed, s, global prompt index),
   and a prompt's G samples depend only on that seed (one ``generate`` call per prompt, or
   one batched call on an engine that takes per-prompt seeds), so a prompt gets the same
   completions whichever rank (and whichever neighbours) it has.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, List

import torch

from nemo_d3s.backends.base import GenerationConfig, RolloutEngine, Rollouts
from nemo_d3s.backends.wrappers import concat_rollouts  # noqa: F401  (its old home)
from nemo_d3s.distributed.groups import ParallelGroups, shard_range
from nemo_d3s.trainer.tasks_adapter import TaskAdapter

__all__ = ["PromptBatch", "PromptSource", "derive_seed", "generate_groups"]


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any printable parts (unlike ``hash``, not salted per process)."""
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class PromptBatch:
    """This rank's prompts for one step.

    problems      [P_local] task problems (opaque to the trainer, handed back to the reward)
    prompts       [P_local] prompt texts as the backend's ``generate`` takes them
    global_index  [P_local] long: position in the step's global prompt list (= group id)
    seeds         [P_local] generation seed per prompt
    """

    problems: List[Any]
    prompts: List[str]
    global_index: torch.Tensor
    seeds: List[int]

    def __len__(self) -> int:
        return len(self.prompts)


class PromptSource:
    """Draws the global prompt list of a step and returns this rank's slice."""

    def __init__(
        self, task: TaskAdapter, prompts_per_step: int, seed: int, groups: ParallelGroups
    ) -> None:
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.lo, self.hi = shard_range(prompts_per_step, groups.dp_rank, groups.dp_size)

    def for_step(self, step: int) -> PromptBatch:
        problems = self.task.sample_train(
            self.prompts_per_step, derive_seed(self.seed, "data", step)
        )
        mine = problems[self.lo : self.hi]
        return PromptBatch(
            problems=mine,
            prompts=[self.task.prompt_text(p) for p in mine],
            global_index=torch.arange(self.lo, self.hi, dtype=torch.long),
            seeds=[derive_seed(self.seed, "gen", step, i) for i in range(self.lo, self.hi)],
        )


def generate_groups(
    engine: RolloutEngine, batch: PromptBatch, n_samples: int, gen: GenerationConfig
) -> Rollouts:
    """G completions per prompt, each prompt sampled from its own seed (rule 2 above; an
    engine that cannot take per-prompt seeds was wrapped at build time, see
    ``backends.wrappers``). Returns [P_local * G] rows, prompt-major."""
    out = engine.generate(batch.prompts, n_samples, gen, list(batch.seeds))
    if len(out.batch) != len(batch) * n_samples:
        raise RuntimeError(
            f"the rollout engine returned {len(out.batch)} rows, expected {len(batch) * n_samples}"
        )
    return out
