"""Spawn gloo ranks on CPU for the distributed tests and bring their results back.

``run_ranks(fn, world_size, *args, tp=..., pp=..., cp=...)`` is
``nemo_d3s.distributed.run_on_gloo_ranks`` with Megatron's parallel state built first
(``parallel_state.initialize_model_parallel`` with TP=tp, PP=pp, CP=cp; DP = the rest) and
one torch thread per rank: the parent gets ``[result of rank 0, result of rank 1, ...]``,
a failing or hanging rank fails the test with its traceback.

Start method: "forkserver" with torch, megatron-core and nemo_d3s PRELOADED in the fork
server. Importing megatron.core costs ~5 s of CPU per process; this machine has two cores,
so spawning 8 fresh interpreters would spend ~20 s importing. The fork server imports once
per test session and forks ranks from that clean, single-threaded process (plain "fork" of
the pytest process could inherit a busy OpenMP pool and deadlock).

Megatron on CPU: ``initialize_model_parallel`` and the tensor-parallel layers
(``use_cpu_initialization=True``, no sequence parallelism) run on gloo as they are; no shim
is needed for them. Only the pipeline schedules allocate on "cuda"; see
``_megatron_cpu.py`` for the one shim the gradient test uses.
"""

from __future__ import annotations

import multiprocessing
import traceback
from typing import Any, Callable, List

from nemo_d3s.distributed.launch import run_on_gloo_ranks
from _limits import WAIT_S  # noqa: E402

__all__ = ["run_ranks"]

_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "nemo_d3s.core",
    "nemo_d3s.distributed",
]


def megatron_setup(rank: int, tp: int, pp: int, cp: int):
    """Rank setup: Megatron's process groups (the backend's own set-up); returns the teardown."""
    from nemo_d3s.backends.megatron.parallel import initialize_megatron_groups

    return initialize_megatron_groups(rank, tp, pp, cp)


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    megatron: bool = True,
    timeout: float = WAIT_S,
) -> List[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; return every rank's result.

    ``fn`` must be a module-level function and its result picklable (move tensors to
    CPU). With ``megatron=True`` Megatron's parallel state is initialised with TP=tp,
    PP=pp, CP=cp (DP = world / (tp pp cp)) before ``fn`` runs.
    """
    setup = dict(rank_setup=megatron_setup, setup_args=(tp, pp, cp)) if megatron else {}
    return run_on_gloo_ranks(fn, world_size, *args, threads=1, timeout=timeout, **setup)


def _set_preload() -> None:
    try:
        multiprocessing.set_forkserver_preload(_PRELOAD)
    except Exception:  # pragma: no cover - preloading is only an optimisation
        traceback.print_exc()


_set_preload()
