"""A resumed run's rollouts generated ahead (``rollout.max_staleness`` >= 1), agreed over the
job before the pipeline starts: every rank must release the same batches, or a model-parallel
engine, which pairs its ranks' generations by order, trains one rank's rollouts at another's
step and then waits."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from nemo_d3s.backends.base import Rollouts
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.errors import RunError
from nemo_d3s.trainer.rollout_store import (
    HeldWeights,
    OtherLayout,
    held_weights_fit,
    load_rollouts,
    optional_held_weights,
    rollouts_file,
    weights_file,
)

__all__ = ["agreed_pending", "load_pending"]

log = logging.getLogger("nemo_d3s.trainer")

Pending = Mapping[int, Tuple[Rollouts, int]]


def load_pending(
    folder: Path, groups: ParallelGroups, prompts: Tuple[int, int], engine: Any
) -> Tuple[Dict[int, Tuple[Rollouts, int]], Optional[HeldWeights]]:
    """This rank's batches (of its prompt slice ``prompts``) and engine weights from checkpoint
    ``folder`` (nothing without files). Collective, one agreement: files of another
    data-parallel layout (a resume at another TP / PP / DP) are dropped on every rank, and
    ``start`` generates those batches again (warned); engine weights that do not fit
    ``engine`` (a resume at another TP / PP or engine count: ``held_weights_fit``) are dropped
    on every rank (warned); an unusable file raises on every rank (it used to raise on its own
    rank only, and the others waited in ``start``)."""
    rank, status, failure, unfit = groups.global_rank, 0.0, None, None
    try:
        path = Path(folder) / rollouts_file(rank)
        batches = load_rollouts(path, prompts) if path.is_file() else {}
        held_path = Path(folder) / weights_file(rank)
        held = optional_held_weights(held_path)
        if held is not None:
            unfit = held_weights_fit(held, engine.held_weights())
    except OtherLayout as e:
        status, failure = 1.0, e
    except RunError as e:
        status, failure = 2.0, e
    # one agreement: 2 * status + (this rank's held weights do not fit its engine)
    agreed = groups.max(2.0 * status + (1.0 if unfit else 0.0))
    if agreed >= 4:
        raise (
            failure
            if status >= 2
            else RunError(
                f"the rollouts {folder} keeps for another rank are unusable (its log says why)"
            )
        )
    if agreed >= 2:
        if groups.is_main:
            log.warning(
                "the rollouts %s keeps were generated at another data-parallel layout "
                "(%s): they are generated again",
                folder,
                failure or "on another rank",
            )
        return {}, None
    if agreed >= 1:  # the batches stand; those due from the held weights are generated anew
        if groups.is_main:
            log.warning(
                "the engine weights %s keeps do not fit this layout's engines (%s): the "
                "batches due from them are generated with the resumed step's weights",
                folder,
                f"{held_path}: {unfit}" if unfit else "on another rank",
            )
        return batches, None
    return batches, held


def agreed_pending(ahead: range, pending: Pending, groups: ParallelGroups) -> Pending:
    """``pending`` when every rank holds the same batches of ``ahead``, else none (warned): a
    model-parallel engine pairs its ranks' generations by order, so ranks releasing different
    batches (a resume at another TP, whose new ranks have no file) trained one rank's rollouts
    at another's step, then waited for each other. Two all-reduces (max) of one float over
    every group."""
    held = float(sum(1 << i for i, j in enumerate(ahead) if j in pending))
    if groups.max(held) == -groups.max(-held):
        return pending
    if groups.is_main:
        log.warning(
            "the ranks resumed with different saved rollouts of steps %s (a resume at another "
            "layout): every rank generates them again, with the resumed weights",
            list(ahead),
        )
    return {}
