"""Train on your own task from Python: register a Task (prompts + a verifiable reward),
compose the Hydra config with overrides, and run the same loop the CLI runs.

    python examples/custom_task.py /tmp/parity_run
"""

from __future__ import annotations

import random
import sys
from typing import List

from nemo_d3s.tasks.base import TASKS, Problem, Task, as_rng
from nemo_d3s.train import compose_config
from nemo_d3s.trainer.loop import train


@TASKS.register("parity")
class ParityTask(Task):
    """'Is N even or odd?' -- reward 1 when the last word of the reply is right."""

    name = "parity"

    def __init__(self, n_eval: int = 16) -> None:
        rng = random.Random(12345)
        self._eval = [self._problem(rng.randrange(10**6, 2 * 10**6)) for _ in range(n_eval)]

    @staticmethod
    def _problem(n: int) -> Problem:
        return Problem(
            prompt=f"Is {n} even or odd? Answer with one word.",
            answer="even" if n % 2 == 0 else "odd",
        )

    def sample_train(self, n: int, rng: random.Random) -> List[Problem]:
        rng = as_rng(rng)
        return [self._problem(rng.randrange(10**6)) for _ in range(n)]  # disjoint from eval ids

    def eval_set(self) -> List[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, response_text: str) -> float:
        words = response_text.strip().lower().rstrip(".!").split()
        return 1.0 if words and words[-1] == problem.answer else 0.0


def main(out_dir: str) -> None:
    cfg = compose_config(
        [
            # tiny random model: add model.name=smollm2-135m-instruct to learn for real
            "experiment=smoke",
            "task.name=parity",
            "task.eval_size=8",
            "trainer.steps=6",
            # rewards in this process: reward worker processes import the module that
            # registered the task, and this script is __main__ (move the task into a module
            # of your own to keep the workers and their time limit)
            "trainer.reward_workers=0",
            f"output_dir={out_dir}",
        ]
    )
    cfg.task.params = {"n_eval": 8}  # replace (not merge with) the tiny task's options
    state = train(cfg)
    print(f"trained {state.step} steps; metrics in {out_dir}/metrics.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/custom_task")
