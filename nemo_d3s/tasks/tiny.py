"""A deterministic toy task for CI runs on a random tiny model: the reward depends on the response
text alone (``mode="fraction"``: share of characters in ``targets``; ``"contains"``: 1 if any
occurs), so even a random model has reward variance inside a group (5 targets over 32 random bytes:
"contains" is 1 about half the time)."""

from __future__ import annotations

import random
from typing import List

from nemo_d3s.core.checks import check_count
from nemo_d3s.tasks.base import TASKS, Problem, Task, as_rng

_EVAL_OFFSET = 1_000_000_000  # eval prompt ids live far above any training id


@TASKS.register("tiny")
class TinyCharTask(Task):
    """Prompts "Request #k: write as many of the letters ... as you can."; reward as above."""

    def __init__(
        self,
        targets: str = "aeiou",
        mode: str = "fraction",
        n_eval: int = 16,
        n_train_prompts: int = 1_000_000,
    ) -> None:
        if not targets:
            raise ValueError("targets must be a non-empty string of characters")
        if mode not in ("fraction", "contains"):
            raise ValueError(f"mode must be 'fraction' or 'contains', got {mode!r}")
        check_count("n_eval", n_eval)
        self.name = "tiny"
        self.targets, self.mode = targets, mode
        if not 1 <= n_train_prompts <= _EVAL_OFFSET:
            raise ValueError(
                f"n_train_prompts must be in [1, {_EVAL_OFFSET}], got {n_train_prompts}"
            )
        self.n_train_prompts = n_train_prompts
        self._eval = [self._problem(_EVAL_OFFSET + i, "eval") for i in range(n_eval)]

    def _problem(self, k: int, split: str) -> Problem:
        letters = ", ".join(self.targets)
        prompt = f"Request #{k}: write as many of the letters {letters} as you can."
        return Problem(prompt=prompt, answer=self.targets, meta={"id": k, "split": split})

    def sample_train(self, n: int, rng: random.Random) -> List[Problem]:
        check_count("n", n)
        rng = as_rng(rng)
        return [self._problem(rng.randrange(self.n_train_prompts), "train") for _ in range(n)]

    def eval_set(self) -> List[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, response_text: str) -> float:
        text = response_text or ""
        hits = sum(ch in problem.answer for ch in text)
        if self.mode == "contains":
            return 1.0 if hits else 0.0
        return hits / len(text) if text else 0.0
