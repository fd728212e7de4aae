"""A generation that a group of ranks waits for together (``distributed/generation_wait.py``):
the call runs while this rank beats, then every rank learns every rank's outcome. Used by the
model-parallel group around its engine's rank (``megatron/engine.py``) and by the trainer
around each rank's generation (its steps and evaluation batches)."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Tuple, TypeVar

from nemo_d3s.backends.base import GenerationInterrupted
from nemo_d3s.distributed.generation_wait import GenerationWait, Outcome

__all__ = ["agreed_generation"]

T = TypeVar("T")
log = logging.getLogger("nemo_d3s.engine")


def agreed_generation(
    wait: GenerationWait,
    alive: Callable[[], bool],
    call: Optional[Callable[[], T]],
    *,
    stopping: bool,
    limit_s: float,
) -> Tuple[Optional[T], Outcome]:
    """``call()`` (None: nothing to generate here) while this rank beats as long as
    ``alive()``, then every rank's outcome (``GenerationWait.agree``): (the result, None when
    interrupted; the outcome). A failure raises on every rank (RuntimeError on the others)."""
    result, interrupted, failure = None, False, None
    if call is not None:
        with wait.beating(alive):
            try:
                result = call()
            except GenerationInterrupted as e:
                log.warning("generation cut short, none of it is used: %s", e)
                interrupted = True
            except Exception as e:  # raised below, once every rank knows
                failure = e
    outcome = wait.agree(
        stopping=stopping, interrupted=interrupted, failed=failure is not None, limit_s=limit_s
    )
    if failure is not None:
        raise failure
    if outcome.failed:
        raise RuntimeError(
            f"the generation failed on {outcome.failed} other rank(s) ({wait.name}); "
            "their log says why"
        )
    return result, outcome
