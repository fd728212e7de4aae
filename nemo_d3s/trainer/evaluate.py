"""Held-out evaluation: greedy decoding (no sampling noise) on a fixed problem set, split into
contiguous per-rank slices; the mean reward over all ranks does not depend on their number.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

from nemo_d3s.backends.base import GenerationConfig, GenerationInterrupted, RolloutEngine
from nemo_d3s.backends.engine_wait import agreed_generation
from nemo_d3s.distributed.generation_wait import GenerationWait, generation_limit_s
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.trainer.tasks_adapter import RewardStopped, TaskAdapter

__all__ = ["evaluate"]


def evaluate(
    engine: RolloutEngine,
    task: TaskAdapter,
    problems: List[Any],
    groups: ParallelGroups,
    *,
    max_new_tokens: int,
    batch_size: int,
    n_show: int = 0,
    should_stop: Optional[Callable[[], bool]] = None,
    on_batch: Optional[Callable[[int, int], None]] = None,
    wait: Optional[GenerationWait] = None,
) -> Dict[str, Any]:
    """eval_reward_mean, eval_n, eval_response_len_mean, eval_reward_errors, time_eval and (rank 0)
    the first ``n_show`` (prompt, completion, reward) as ``samples``.

    ``should_stop`` is asked before each batch; after each batch's generation the ranks agree
    (``wait``: ``backends/engine_wait.py``) whether any has a stop pending or a cut generation:
    then ``{"stopped": True}``, no partial row. ``on_batch(done, total)`` after each batch.
    """
    t0 = time.perf_counter()
    n = len(problems)
    lo, hi = groups.dp_rank * n // groups.dp_size, (groups.dp_rank + 1) * n // groups.dp_size
    mine = problems[lo:hi]
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)
    total, errors, length, shown = 0.0, 0, 0.0, []
    largest = -(-n // groups.dp_size)  # the biggest rank slice: every rank runs as many batches
    n_batches = -(-largest // batch_size)
    wait = wait or GenerationWait("eval", 1, 0, 0)
    stopping = should_stop or (lambda: False)
    limit = generation_limit_s(wait.base_s, batch_size, max_new_tokens)
    for start in range(0, largest, batch_size):
        if on_batch is not None:  # batches done so far (0 first: the bar shows at once)
            on_batch(start // batch_size, n_batches)
        chunk = mine[start : start + batch_size]
        texts = [task.prompt_text(p) for p in chunk]
        call = (lambda: engine.generate(texts, 1, gen, [0] * len(texts))) if chunk else None
        stop = stopping()
        ro, agreed = agreed_generation(
            wait, engine.alive, None if stop else call, stopping=stop, limit_s=limit
        )
        if agreed.interrupted and should_stop is None:
            raise GenerationInterrupted("the generation of an evaluation batch was cut short")
        if agreed.stopping or agreed.interrupted:
            return {"stopped": True}
        if ro is None:
            continue
        length += float(ro.batch.response_mask.sum())
        try:
            rewards, failures = task.score(chunk, ro.response_texts, 1)
        except RewardStopped:
            if should_stop is None:
                raise
            continue  # the stop flag is set: the next agreement stops every rank
        total += float(rewards.sum())
        errors += sum(failures.values())
        for p, text, r in zip(chunk, ro.response_texts, rewards.tolist()):
            if len(shown) < n_show:
                shown.append({"prompt": task.prompt_text(p), "completion": text, "reward": r})
    if on_batch is not None and n_batches:
        on_batch(n_batches, n_batches)
    if should_stop is not None and groups.max(1.0 if should_stop() else 0.0) > 0:
        return {"stopped": True}
    s = groups.sum(
        {"reward": total, "errors": float(errors), "length": length, "n": float(len(mine))}
    )
    return {
        "eval_reward_mean": s["reward"] / max(s["n"], 1.0),
        "eval_n": int(s["n"]),
        "eval_response_len_mean": s["length"] / max(s["n"], 1.0),
        "eval_reward_errors": int(s["errors"]),
        "time_eval": time.perf_counter() - t0,
        "samples": shown,
    }
