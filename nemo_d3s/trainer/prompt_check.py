"""Prompt length (plus the tokens a rollout or evaluation adds) against the model's context,
checked when the task loads: every problem of a finite dataset, else the eval set and the
first draw. ``task.long_prompts=error`` names the split and row; ``skip`` drops them. A policy
reporting no ``context_length`` is not checked.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Dict, List, Optional, Sequence

from nemo_d3s.errors import ConfigError

__all__ = ["check_prompt_lengths", "context_length", "prompt_counter"]

log = logging.getLogger("nemo_d3s.trainer")

# No tokenizer packs more than this many characters into one token on average: a longer
# text is over the limit without being tokenized (a 30 MB line is not fed to a tokenizer).
_MAX_CHARS_PER_TOKEN = 64


def context_length(policy: Any) -> Optional[int]:
    n = policy.context_length
    return n if isinstance(n, int) and n > 0 else None


def prompt_counter(policy: Any) -> Optional[Callable[[Sequence[str]], List[int]]]:
    """``policy.prompt_token_counts`` when the policy can count (a test probes it once)."""
    if policy.prompt_token_counts([]) is None:
        return None
    return policy.prompt_token_counts


def check_prompt_lengths(cfg: Any, policy: Any, task: Any) -> Dict[str, int]:
    """Check (and with ``skip``, drop) too-long prompts of ``task`` (a tasks.base.Task).
    Returns the number dropped per split ({} when nothing was dropped)."""
    t = cfg.trainer
    new_tokens = max(int(t.max_new_tokens), int(t.eval_max_new_tokens or t.max_new_tokens))
    limit = cfg.task.max_prompt_tokens
    ctx = context_length(policy)
    key = "task.max_prompt_tokens"
    if limit is None:
        if ctx is None:
            log.info("prompt lengths not checked: the policy does not report its context length")
            return {}
        limit, key = ctx - new_tokens, f"the model's context ({ctx}) minus {new_tokens} new tokens"
        if limit < 1:
            raise ConfigError(
                f"trainer.max_new_tokens={new_tokens}: leaves no room for a prompt in the model's "
                f"context of {ctx} positions"
            )
    count = prompt_counter(policy)
    if count is None:
        log.info("prompt lengths not checked: the policy has no tokenizer")
        return {}

    finite = task.finite_problems() if hasattr(task, "finite_problems") else None
    if finite is None:
        finite = {
            "eval": list(task.eval_set()),
            "train (first draw)": list(task.sample_train(64, random.Random(0))),
        }
    too_long: Dict[int, int] = {}  # id(problem) -> tokens (or -1: over the limit by characters)
    first: Optional[str] = None
    for split, problems in finite.items():
        texts = [p.prompt for p in problems]
        short = [i for i, x in enumerate(texts) if len(x) <= _MAX_CHARS_PER_TOKEN * limit]
        counts = dict(zip(short, count([texts[i] for i in short]))) if short else {}
        for i, p in enumerate(problems):
            n = counts.get(i, -1)
            if n == -1 or n > limit:
                too_long[id(p)] = n
                if first is None:
                    where = _where(p, split, i)
                    size = f"{len(p.prompt):,} characters" if n == -1 else f"{n} tokens"
                    first = f"{where}: prompt of {size}"
    if not too_long:
        return {}
    msg = f"{len(too_long)} prompt(s) are longer than {limit} tokens ({key}); first: {first}"
    if cfg.task.long_prompts == "error":
        raise ConfigError(msg + ". Set task.long_prompts=skip to drop them, or shorten them")
    try:
        dropped = task.drop_problems(lambda p: id(p) in too_long)
    except NotImplementedError:
        raise ConfigError(
            msg + f"; task {getattr(task, 'name', task)!r} generates its problems and cannot "
            "skip rows: raise task.max_prompt_tokens or use a model with a longer context"
        ) from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.warning(
        "%s; skipped (task.long_prompts=skip): %s",
        msg,
        ", ".join(f"{v} {k}" for k, v in dropped.items()),
    )
    return dropped


def _where(problem: Any, split: str, index: int) -> str:
    meta = getattr(problem, "meta", {}) or {}
    if "row" in meta:
        where = meta.get("where") or f"row {meta['row']}"  # "line N" for a JSONL file
        return f"{meta.get('source', split)} {where}"
    return f"{split} problem {index + 1}"
