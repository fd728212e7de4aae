"""Checks across a dataset's rows, by content (the questions are in memory): an evaluation
file that repeats training questions, and a question given two different reference answers."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from nemo_d3s.tasks.base import Problem

__all__ = ["drop_overlap", "warn_conflicting_answers"]

log = logging.getLogger("nemo_d3s.tasks")


def _where(p: Problem) -> str:
    return str(p.meta.get("where", "row ?"))


def drop_overlap(
    train: List[Problem], evals: List[Problem], train_path: str, eval_path: Optional[str]
) -> List[Problem]:
    """``train`` without the questions ``evals`` holds (an evaluation on rows it trains on
    measures memorisation), with a warning naming them; a ValueError when every training
    question is an evaluation question (the same data in another file). ``eval_path`` None:
    ``evals`` are rows held out of the training file itself, which may repeat a question."""
    held = {p.prompt for p in evals}
    kept = [p for p in train if p.prompt not in held]
    if len(kept) == len(train):
        return train
    if not kept and eval_path is None:
        raise ValueError(
            f"task.params.train_path={str(train_path)!r}: every training question is also "
            f"among the {len(evals)} rows held out for evaluation (the file repeats its "
            "questions); lower task.params.n_eval or give task.params.eval_path"
        )
    if not kept:
        raise ValueError(
            f"task.params.eval_path={str(eval_path)!r} holds every question of "
            f"task.params.train_path={str(train_path)!r}: the evaluation would score the rows "
            "it trains on; name another file, or leave eval_path null to hold "
            "task.params.n_eval rows out of the training file"
        )
    dropped = [p for p in train if p.prompt in held]
    log.warning(
        "task.params.train_path: %d of %d questions are in %s too (%s%s); "
        "left out of training so that the evaluation scores unseen questions",
        len(dropped),
        len(train),
        "task.params.eval_path" if eval_path is not None else "the rows held out for evaluation",
        ", ".join(_where(p) for p in dropped[:3]),
        " ..." if len(dropped) > 3 else "",
    )
    return kept


def warn_conflicting_answers(key: str, problems: List[Problem]) -> int:
    """Warn once about questions given different reference answers (at most one can be
    rewarded as right); how many such questions."""
    first: Dict[str, Problem] = {}
    clashes = []
    for p in problems:
        seen = first.setdefault(p.prompt, p)
        if seen is not p and seen.answer != p.answer:
            clashes.append((seen, p))
    if clashes:
        shown = "; ".join(
            f"{_where(a)}: {a.answer!r} vs {_where(b)}: {b.answer!r}" for a, b in clashes[:3]
        )
        log.warning(
            "%s: %d question(s) appear with different reference answers (%s%s); a response "
            "can match only one of them",
            key,
            len(clashes),
            shown,
            " ..." if len(clashes) > 3 else "",
        )
    return len(clashes)
