"""Megatron's process groups for a rank: the one place outside tests that calls
``parallel_state.initialize_model_parallel`` for gloo/CPU launches (the test and benchmark
rank launchers hand this to ``nemo_d3s.distributed.run_on_gloo_ranks`` as ``rank_setup``)."""

from __future__ import annotations

import os
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "DEFAULT_ORDER",
    "TP_PP_DP_ORDER",
    "engine_blocks",
    "engine_ranks_of_model_copies",
    "first_ranks_of_model_copies",
    "global_rank_of",
    "initialize_megatron_groups",
    "context_parallel_gloo_group",
    "context_parallel_groups",
    "model_parallel_gloo_group",
    "rank_order",
    "set_cuda_connections",
]


DEFAULT_ORDER, TP_PP_DP_ORDER = "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"


def rank_order(use_tp_pp_dp_mapping: bool) -> str:
    """Megatron's ``order`` for its ``use_tp_pp_dp_mapping`` flag."""
    return TP_PP_DP_ORDER if use_tp_pp_dp_mapping else DEFAULT_ORDER


def global_rank_of(
    tp_rank: int,
    pp_rank: int,
    dp_rank: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    order: str = DEFAULT_ORDER,
    cp_rank: int = 0,
    cp: int = 1,
) -> int:
    """The global rank Megatron gives a (TP, CP, PP, DP) position (no EP): CP varies right
    after TP in both orders."""
    inner = tp_rank + tp * cp_rank
    if order == DEFAULT_ORDER:
        return inner + tp * cp * (dp_rank + dp * pp_rank)
    if order == TP_PP_DP_ORDER:
        return inner + tp * cp * (pp_rank + pp * dp_rank)
    raise ValueError(f"rank order {order!r}: only {DEFAULT_ORDER} and {TP_PP_DP_ORDER}")


def first_ranks_of_model_copies(
    tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER, cp: int = 1
) -> List[int]:
    """Global rank of (TP rank 0, stage 0) of each TP x PP model-parallel group, DP replica
    then CP rank order (where one rollout engine per group starts): tp-cp-ep-dp-pp interleaves
    the replicas' first stages (stride TP CP), tp-cp-ep-pp-dp keeps each copy on consecutive
    ranks (stride TP CP PP). In both orders it is the group's lowest rank: one block of
    :func:`engine_ranks_of_model_copies`."""
    return engine_ranks_of_model_copies(tp, pp, dp, order, cp, engines_per_copy=1)


def engine_blocks(ranks: Sequence[int], engines: int) -> List[List[int]]:
    """A model-parallel group's ranks (any order) cut into ``engines`` blocks of consecutive
    ranks in ascending order; each block's first rank builds an engine. ValueError when
    ``engines`` does not divide the group."""
    ordered, n, e = sorted(int(r) for r in ranks), len(ranks), int(engines)
    if e < 1 or n % e:
        raise ValueError(
            f"model.params.rollout_engines_per_copy={engines}: must divide the {n} ranks of a "
            "TP x PP group"
        )
    size = n // e
    return [ordered[i * size : (i + 1) * size] for i in range(e)]


def engine_ranks_of_model_copies(
    tp: int,
    pp: int,
    dp: int,
    order: str = DEFAULT_ORDER,
    cp: int = 1,
    engines_per_copy: int = 1,
) -> List[int]:
    """Where the rollout engines start: per TP x PP group (DP replica, then CP rank order),
    the first rank of each of its ``engines_per_copy`` blocks (:func:`engine_blocks`); one
    engine per group is :func:`first_ranks_of_model_copies`."""
    out = []
    for k in range(dp):
        for c in range(cp):
            group = [
                global_rank_of(t, p, k, tp=tp, pp=pp, dp=dp, order=order, cp_rank=c, cp=cp)
                for t in range(tp)
                for p in range(pp)
            ]
            out += [b[0] for b in engine_blocks(group, engines_per_copy)]
    return out


def set_cuda_connections() -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless set: one work queue, the kernel order TP
    overlap relies on (megatron-core 0.16.1 ``tensor_parallel/layers.py:526-558``). Call it
    before CUDA initialises; later it only warns."""
    import torch

    if "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        warnings.warn(
            "CUDA was initialised before CUDA_DEVICE_MAX_CONNECTIONS=1 was set: it does "
            "not apply to this process; export it before starting Python (slurm/*.sbatch "
            "do)",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


_MP_GLOO = None  # this rank's gloo twin of Megatron's model-parallel group
_CP_GLOO = None  # ... and of its context-parallel group (CP > 1)


def initialize_megatron_groups(
    rank: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    order: str = DEFAULT_ORDER,
    vpp: Optional[int] = None,
    timeout_minutes: Optional[float] = None,
    ep: int = 1,
    etp: Optional[int] = None,
) -> Callable[[], None]:
    """Build Megatron's groups in ``order`` (``vpp`` chunks per stage, experts at ``ep`` x
    ``etp``, None: TP) and the model-parallel gloo twin, every group waiting
    ``timeout_minutes``; returns the teardown. ``rank`` is unused (the ``rank_setup``
    signature)."""
    set_cuda_connections()  # (a no-op when the backend or the launcher set it first)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed.timeouts import apply_timeout, as_timedelta

    extra = {} if not timeout_minutes else {"distributed_timeout_minutes": float(timeout_minutes)}
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        order=order,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **extra,
    )
    make_model_parallel_gloo_twin(tp, pp, order, timeout_minutes, cp=cp)
    apply_timeout(as_timedelta(timeout_minutes))

    def teardown() -> None:
        global _MP_GLOO, _CP_GLOO
        _MP_GLOO = _CP_GLOO = None
        ps.destroy_model_parallel()

    return teardown


def _rank_groups(
    tp: int, pp: int, dp: int, order: str, cp: int, *, varying: str
) -> List[List[int]]:
    """Every rank's global number grouped by the coordinates other than ``varying`` ("mp":
    TP and stage vary within a group; "cp": the CP rank does), each group sorted, the groups
    in (DP, CP) / (DP, stage, TP) order."""
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for d in range(dp):
        for c in range(cp):
            for p in range(pp):
                for t in range(tp):
                    key = (d, c) if varying == "mp" else (d, p, t)
                    rank = global_rank_of(
                        t, p, d, tp=tp, pp=pp, dp=dp, order=order, cp_rank=c, cp=cp
                    )
                    groups.setdefault(key, []).append(rank)
    return [sorted(groups[k]) for k in sorted(groups)]


def model_parallel_groups(
    tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER, cp: int = 1
) -> List[List[int]]:
    """The global ranks of every model-parallel (TP x PP) group, one per (DP, CP) rank,
    sorted: a pure function of the layout (no collective). EP = 1."""
    return _rank_groups(tp, pp, dp, order, cp, varying="mp")


def context_parallel_groups(
    tp: int, pp: int, dp: int, order: str = DEFAULT_ORDER, cp: int = 1
) -> List[List[int]]:
    """The global ranks of every context-parallel group (the CP ranks of one TP rank, stage
    and DP replica): a pure function of the layout. EP = 1."""
    return _rank_groups(tp, pp, dp, order, cp, varying="cp")


def make_model_parallel_gloo_twin(
    tp: int,
    pp: int,
    order: str = DEFAULT_ORDER,
    timeout_minutes: Optional[float] = None,
    *,
    cp: int = 1,
):
    """Create the gloo twin of every model-parallel group (collective over the world, no NCCL
    call) and keep this rank's: engine waits then stay on the host, off the engine's GPUs.
    At CP > 1 also the context-parallel groups' twins (:func:`context_parallel_gloo_group`)."""
    global _MP_GLOO, _CP_GLOO
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_d3s.distributed.timeouts import as_timedelta

    dp = dist.get_world_size() // (tp * pp * cp)
    timeout = as_timedelta(timeout_minutes)

    def twin(what: str, groups: List[List[int]], megatron_group):
        mine = sorted(dist.get_process_group_ranks(megatron_group))
        if mine not in groups:
            raise RuntimeError(
                f"Megatron's {what} group {mine} is not one of {groups} (layout {tp}x{pp}, "
                f"CP {cp}, order {order})"
            )
        group, _ = dist.new_subgroups_by_enumeration(
            groups, backend="gloo", **({"timeout": timeout} if timeout else {})
        )
        return group

    mp = model_parallel_groups(tp, pp, dp, order, cp)
    _MP_GLOO = twin("model-parallel", mp, ps.get_model_parallel_group())
    _CP_GLOO = None
    if cp > 1:  # the CP ranks of a copy share its prompts' generation (cp_rollouts.py)
        groups = context_parallel_groups(tp, pp, dp, order, cp)
        _CP_GLOO = twin("context-parallel", groups, ps.get_context_parallel_group())
    return _MP_GLOO


def context_parallel_gloo_group():
    """This rank's gloo twin of the context-parallel group (None at CP 1 or before
    :func:`make_model_parallel_gloo_twin`)."""
    return _CP_GLOO


def model_parallel_gloo_group():
    """This rank's gloo twin of the model-parallel group (None before
    :func:`initialize_megatron_groups` / :func:`make_model_parallel_gloo_twin`)."""
    return _MP_GLOO
