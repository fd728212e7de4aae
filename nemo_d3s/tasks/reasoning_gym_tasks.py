"""Procedural tasks from the ``reasoning-gym`` package (CPU-friendly, unlimited data).

Entry ``idx`` comes from ``Random(seed + idx)``: training draws from ``[0, train_size)`` of the
dataset seeded ``seed``, the eval set is ``[0, n_eval)`` of the one seeded ``seed + train_size``,
and training draws whose question is in the eval set are rejected too. Rewards are exact
(``score_answer`` must give full marks) unless ``partial_credit=True``."""

from __future__ import annotations

import random
from typing import Any, Dict, List, Optional

from nemo_d3s.tasks.answers import extract_answer
from nemo_d3s.core.checks import check_count
from nemo_d3s.tasks.base import TASKS, Problem, Task, as_rng

ANSWER_SUFFIX = "\n\nEnd your reply with a final line of the form 'Answer: <your answer>'."
_MAX_REJECTION_ROUNDS = 1000
_MISSES_BEFORE_EXHAUSTED = 2000


class ReasoningGymTask(Task):
    """Adapter over ``reasoning_gym.create_dataset(dataset, size=, seed=, **config)``. answer_kind:
    "number" (last number, normalised) or "text" (the tagged segment as written); prompt_suffix asks
    for a parseable final answer."""

    def __init__(
        self,
        dataset: str,
        config: Optional[Dict[str, Any]] = None,
        *,
        name: Optional[str] = None,
        answer_kind: str = "number",
        prompt_suffix: str = ANSWER_SUFFIX,
        n_eval: int = 128,
        seed: int = 0,
        train_size: int = 1_000_000,
        partial_credit: bool = False,
    ) -> None:
        import reasoning_gym

        check_count("n_eval", n_eval)
        if train_size < 1:
            raise ValueError(f"train_size must be >= 1, got {train_size}")
        self.name = name or dataset
        self.dataset_name = dataset
        self.config = dict(config or {})
        self.answer_kind = answer_kind
        self.prompt_suffix = prompt_suffix
        self.partial_credit = partial_credit
        self._train = reasoning_gym.create_dataset(
            dataset, size=train_size, seed=seed, **self.config
        )
        # The eval dataset's virtual size only bounds the indices we may read from it.
        self._eval_ds = reasoning_gym.create_dataset(
            dataset,
            size=max(n_eval, 1) * _MAX_REJECTION_ROUNDS,
            seed=seed + train_size,
            **self.config,
        )
        self._eval = self._distinct_eval(n_eval)
        self._eval_questions = {p.meta["question"] for p in self._eval}

    def _distinct_eval(self, n_eval: int) -> List[Problem]:
        # Repeated questions would weight some problems twice in eval accuracy.
        # A task with fewer distinct questions than n_eval is found out after a run of draws
        # with nothing new (ten times the questions seen, at least _MISSES_BEFORE_EXHAUSTED),
        # not after n_eval x _MAX_REJECTION_ROUNDS draws (a minute for n_eval=1000).
        out, seen, misses = [], set(), 0
        for idx in range(n_eval * _MAX_REJECTION_ROUNDS):
            if len(out) == n_eval or misses > max(_MISSES_BEFORE_EXHAUSTED, 10 * len(seen)):
                break
            problem = self._problem(self._eval_ds, idx, "eval")
            if problem.meta["question"] not in seen:
                seen.add(problem.meta["question"])
                out.append(problem)
                misses = 0
            else:
                misses += 1
        if len(out) < n_eval:
            raise ValueError(
                f"task {self.name!r}: n_eval={n_eval} exceeds the {len(out)} distinct "
                "questions this difficulty allows; lower task.eval_size or widen the task "
                "with task.params.config"
            )
        return out

    def _problem(self, ds, idx: int, split: str) -> Problem:
        entry = ds[idx]
        meta = {"question": entry["question"], "entry": entry, "index": idx, "split": split}
        return Problem(
            prompt=entry["question"] + self.prompt_suffix, answer=str(entry["answer"]), meta=meta
        )

    def sample_train(self, n: int, rng: random.Random) -> List[Problem]:
        check_count("n", n)
        rng = as_rng(rng)
        out: List[Problem] = []
        for _ in range(n * _MAX_REJECTION_ROUNDS):
            if len(out) == n:
                break
            problem = self._problem(self._train, rng.randrange(len(self._train)), "train")
            if problem.meta["question"] not in self._eval_questions:
                out.append(problem)
        if len(out) < n:
            raise RuntimeError(
                f"task {self.name!r}: could not draw {n} training problems outside the eval set; "
                "the difficulty allows too few distinct questions for this n_eval"
            )
        return out

    def eval_set(self) -> List[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, response_text: str) -> float:
        answer = extract_answer(response_text, self.answer_kind)
        if answer is None:
            return 0.0
        score = float(self._train.score_answer(answer, problem.meta["entry"]))
        if self.partial_credit:
            return score
        return 1.0 if score >= 1.0 else 0.0


@TASKS.register("reasoning_gym")
def reasoning_gym_task(dataset: str, **options) -> ReasoningGymTask:
    """Any reasoning-gym dataset: ``make_task("reasoning_gym", dataset="leg_counting",
    config={...})``."""
    return ReasoningGymTask(dataset, **options)


def _preset(
    name: str,
    dataset: str,
    defaults: Dict[str, Any],
    answer_kind: str = "number",
    n_eval: int = 128,
):
    def factory(config: Optional[Dict[str, Any]] = None, **options) -> ReasoningGymTask:
        merged = {**defaults, **(config or {})}
        options.setdefault("answer_kind", answer_kind)
        options.setdefault("n_eval", n_eval)
        return ReasoningGymTask(dataset, merged, name=name, **options)

    factory.__doc__ = (
        f"reasoning-gym {dataset!r} with defaults {defaults} (override with config={{...}})."
    )
    TASKS.register(name)(factory)
    return factory


# Easy presets: two single-digit terms, where the base SmolLM2-135M-Instruct is right some
# of the time, so GRPO groups have reward variance from the start. Measured at
# temperature 1.0 on 64 eval problems: chain_sum 2 terms 14% (2-3 terms: 5%);
# basic_arithmetic 1 digit 11% (1-2 digits: 9%). These settings allow
# only 200 distinct questions, so the held-out eval set defaults to 64 of them (the other
# 136 remain for training).
chain_sum = _preset(
    "chain_sum",
    "chain_sum",
    {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    n_eval=64,
)
basic_arithmetic = _preset(
    "basic_arithmetic",
    "basic_arithmetic",
    {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ("+", "-"),
        "allow_parentheses": False,
        "allow_negation": False,
    },
    n_eval=64,
)
# Harder presets for larger models.
gsm_symbolic = _preset("gsm_symbolic", "gsm_symbolic", {})
countdown = _preset(
    "countdown",
    "countdown",
    {"min_numbers": 3, "max_numbers": 4, "max_target": 100, "min_target": 10},
    "text",
)
