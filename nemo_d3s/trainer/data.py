"""Prompts for each step, layout-independent seeds, and batching of per-prompt rollouts.

The step's global prompt list is a pure function of (seed, step); each rank keeps a contiguous
slice. A prompt's generation seed is a pure function of (seed, step, global index), and its G
samples depend only on it, so a prompt gets the same completions on any rank and on resume.
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
    """This rank's P_local prompts for one step: ``problems`` (opaque, handed to the reward),
    ``prompts`` (texts), ``global_index`` [P_local] long (= group id), ``seeds``.
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
    """G completions per prompt, each from its own seed: [P_local * G] rows, prompt-major."""
    out = engine.generate(batch.prompts, n_samples, gen, list(batch.seeds))
    if len(out.batch) != len(batch) * n_samples:
        raise RuntimeError(
            f"the rollout engine returned {len(out.batch)} rows, expected {len(batch) * n_samples}"
        )
    return out
