"""What a run records beside the metrics rows: running totals, the reward checks (failures for
``trainer.max_failed_reward_steps`` steps stop the run; a constant reward is warned about),
``summary.json`` and ``interrupted.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict

from nemo_d3s.trainer.checkpoint import TrainerState
from nemo_d3s.errors import RunError
from nemo_d3s.files import atomic_write_text

__all__ = [
    "CONSTANT_REWARD_STEPS",
    "INTERRUPTED_MARKER",
    "accumulate",
    "check_constant_reward",
    "check_reward_failures",
    "summary",
    "totals",
    "write_interrupted_marker",
]

log = logging.getLogger("nemo_d3s.trainer")

# Written by rank 0 when a stop signal ended the run at a checkpoint; the sbatch scripts
# requeue when they find it (torchrun hides the ranks' exit codes).
INTERRUPTED_MARKER = "interrupted.json"
# Steps in a row with one reward for every rollout before the run warns (once) about it.
CONSTANT_REWARD_STEPS = 5


def accumulate(state: TrainerState, m: Dict[str, float]) -> None:
    state.update_tokens_total += float(m.get("update_tokens", 0.0))
    state.rollout_tokens_total += float(m.get("rollout_tokens", 0.0))
    state.skipped_steps += int(m.get("skipped", 0.0))
    state.reward_errors_total += int(m.get("reward_errors", 0.0))


def totals(state: TrainerState) -> Dict[str, float]:
    return {
        "update_tokens_total": state.update_tokens_total,
        "rollout_tokens_total": state.rollout_tokens_total,
        "skipped_steps_total": float(state.skipped_steps),
        "reward_errors_total": float(state.reward_errors_total),
    }


def check_reward_failures(
    state: TrainerState, m: Dict[str, float], n_rollouts: int, limit: int, task_name: str
) -> None:
    """Stop when the reward function failed on every call for ``limit`` consecutive steps
    (a broken verifier would otherwise let the run "finish" with every step skipped)."""
    all_failed = float(m.get("reward_errors", 0.0)) >= n_rollouts
    run = int(state.extra.get("failed_reward_steps", 0)) + 1 if all_failed else 0
    state.extra["failed_reward_steps"] = run
    if limit and run >= limit:
        raise RunError(
            f"the reward function of task {task_name!r} failed on every call in "
            f"{run} consecutive steps (steps {state.step - run + 1}-{state.step}; its "
            "errors are in the warnings above). Fix the verifier; "
            f"trainer.max_failed_reward_steps={limit} sets how many such steps stop a "
            "run"
        )


def check_constant_reward(state: TrainerState, m: Dict[str, float], *, is_main: bool) -> None:
    """Warn once when every rollout got the same reward for ``CONSTANT_REWARD_STEPS`` steps in a
    row (usually a verifier that cannot read the answers).
    """
    same = m.get("reward_std", 1.0) == 0.0 and m.get("reward_max") == m.get("reward_mean")
    run = int(state.extra.get("constant_reward_steps", 0)) + 1 if same else 0
    state.extra["constant_reward_steps"] = run
    if run == CONSTANT_REWARD_STEPS and is_main:
        log.warning(
            "every rollout of the last %d steps (steps %d-%d) got reward %s: with no "
            "difference inside any group every advantage is 0 and nothing is learned "
            "(each update is skipped). Check the task's verifier against its "
            "references (task.params.answer_field / answer_format) and the evaluation "
            "samples",
            run,
            state.step - run + 1,
            state.step,
            m.get("reward_mean"),
        )


def summary(state: TrainerState, out: Path, task: Any) -> Dict[str, Any]:
    """The run's ``summary.json`` (written by rank 0) from its state and ``eval.jsonl``."""
    from nemo_d3s.trainer.metrics import read_jsonl

    evals = read_jsonl(out / "eval.jsonl")
    row = {
        "steps": state.step,
        "eval_reward_first": evals[0]["eval_reward_mean"] if evals else None,
        "eval_reward_last": evals[-1]["eval_reward_mean"] if evals else None,
        **totals(state),
        "reward_out_of_range_total": int(state.extra.get("reward_out_of_range", 0)),
        # dataset rows whose reference the verifier cannot check (reward 0 whatever the answer)
        "unusable_references": int(getattr(task, "unusable_references", 0)),
        "wall_time": state.wall_time_total,
    }
    atomic_write_text(out / "summary.json", json.dumps(row, indent=1))
    return row


def write_interrupted_marker(out: Path, marker: Dict[str, Any]) -> None:
    """``interrupted.json`` (rank 0): where a stop signal ended the run."""
    atomic_write_text(out / INTERRUPTED_MARKER, json.dumps(marker) + "\n")
