"""Which GPUs each vLLM engine gets (pure arithmetic: no torch, no vLLM import).

Why it is needed: vLLM picks its devices itself. Its single-process executor runs its one
worker at local rank 0, i.e. on ``cuda:0`` unless the device string names another
(vllm 0.33 ``v1/executor/uniproc_executor.py:86-88``); the multiprocess executor starts its
TP workers at local ranks 0..TP-1 (``v1/executor/multiproc_executor.py:205-226``), and a
CUDA worker binds ``cuda:<local rank>`` of the devices it sees (``v1/worker/gpu_worker.py:
454, 492-496``, through ``ParallelConfig.get_local_gpu_index``, ``config/parallel.py:
842-856``, which adds nothing for one data-parallel engine). So without help every
engine of a node lands on its first GPUs: four TP-2 engines of the 8B recipe on GPUs 0-1,
eight engines of ``train_dp.sbatch`` on GPU 0.

The fix: the engine of a rank at local rank L sees ``CUDA_VISIBLE_DEVICES`` = the node's
visible devices L, L+1, ..., L+TP-1 (TP = ``rollout.tensor_parallel_size``), set while vLLM
starts its processes (they read it when they initialise CUDA; the trainer's process, whose
CUDA is already up, keeps its own view). Its GPUs are then exactly the GPUs of the ranks
L..L+TP-1 of that node, which is what a colocated refit needs (each engine worker shares its
GPU with the trainer rank that holds the same full tensors, ``backends/refit.py``).

:func:`engine_placement` checks a whole layout: every engine inside its node, no GPU carrying
two engines. It is what the runtime checks before building engines (every rank computes the
same answer, no collective) and what the dry run reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = [
    "EnginePlacement",
    "engine_devices",
    "engine_placement",
    "local_gpus",
    "placement_summary",
]


def local_gpus(visible: Optional[str], gpus_on_node: int) -> List[str]:
    """The node's devices as CUDA names them for this process: the entries of
    ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) when it is set, else ``0..gpus_on_node-1``."""
    if visible is not None and visible.strip() != "":
        return [d.strip() for d in visible.split(",") if d.strip() != ""]
    return [str(i) for i in range(int(gpus_on_node))]


def engine_devices(
    local_rank: int,
    tensor_parallel_size: int,
    *,
    visible: Optional[str] = None,
    gpus_on_node: int = 8,
) -> List[str]:
    """``CUDA_VISIBLE_DEVICES`` entries for the engine built by the rank at ``local_rank``:
    ``tensor_parallel_size`` of the node's devices from ``local_rank`` on.

    ValueError when they run past the node's devices (the engine would need GPUs of
    another node, or GPUs that are not there)."""
    devices = local_gpus(visible, gpus_on_node)
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise ValueError(f"rollout.tensor_parallel_size={tp}: must be >= 1")
    if not 0 <= local_rank < len(devices):
        raise ValueError(
            f"local rank {local_rank} has no GPU: the node shows {len(devices)} "
            f"({','.join(devices)})"
        )
    if local_rank + tp > len(devices):
        raise ValueError(
            f"rollout.tensor_parallel_size={tp}: the engine of local rank {local_rank} needs GPUs "
            f"{local_rank}..{local_rank + tp - 1}, the node has {len(devices)} "
            "(an engine spans one node, starting at its rank's GPU)"
        )
    return devices[local_rank : local_rank + tp]


@dataclass(frozen=True)
class EnginePlacement:
    """One engine: the global rank that builds it, its node, the local rank, and the local
    GPU indices it owns (``gpus``)."""

    rank: int
    node: int
    local_rank: int
    gpus: List[int]


def engine_placement(
    engine_ranks: Sequence[int],
    *,
    gpus_per_node: int,
    tensor_parallel_size: int,
    ranks_per_node: Optional[int] = None,
) -> List[EnginePlacement]:
    """Where every engine of a job runs. ``engine_ranks``: the global ranks that build one
    (every rank for a replicated policy; the first rank of each TP x PP group for Megatron,
    ``parallel.first_ranks_of_model_copies``), ranks numbered node by node with
    ``ranks_per_node`` (default ``gpus_per_node``: one rank per GPU) each, as torchrun / srun
    number them; rank i of a node trains on the node's GPU i.

    ValueError naming the two engines when a GPU would carry two of them (vLLM's memory
    budget ``gpu_memory_utilization`` is per engine: two engines on one GPU each count the
    other's memory as theirs), or when an engine runs past its node."""
    tp = int(tensor_parallel_size)
    out: List[EnginePlacement] = []
    owner: Dict[tuple, int] = {}
    for r in sorted(int(x) for x in engine_ranks):
        node, local = divmod(r, int(ranks_per_node or gpus_per_node))
        gpus = [int(d) for d in engine_devices(local, tp, gpus_on_node=gpus_per_node)]
        for g in gpus:
            if (node, g) in owner:
                raise ValueError(
                    f"rollout.tensor_parallel_size={tp}: the engines of ranks "
                    f"{owner[(node, g)]} and {r} would share GPU {g} of node {node} "
                    "(engines start at ranks "
                    f"{sorted(engine_ranks)[:8]}{'...' if len(engine_ranks) > 8 else ''}, "
                    f"{gpus_per_node} GPUs per node): use a vLLM TP no larger than the "
                    "spacing of those ranks (for Megatron: the training TP, or TP x PP "
                    "with model.params.use_tp_pp_dp_mapping=true)"
                )
            owner[(node, g)] = r
        out.append(EnginePlacement(rank=r, node=node, local_rank=local, gpus=gpus))
    return out


def placement_summary(
    placements: Sequence[EnginePlacement], gpus_per_node: int
) -> Mapping[str, object]:
    """JSON-able record of a placement for the dry run: engines per node, each engine's GPUs,
    the engines on the busiest GPU (1 after :func:`engine_placement`'s check) and the GPUs
    that carry an engine shard."""
    per_node: Dict[int, int] = {}
    for p in placements:
        per_node[p.node] = per_node.get(p.node, 0) + 1
    return {
        "engines": len(placements),
        "engines_per_node": {str(k): v for k, v in sorted(per_node.items())},
        "engine_gpus": {str(p.rank): [f"node{p.node}:gpu{g}" for g in p.gpus] for p in placements},
        "shards_per_gpu": 1 if placements else 0,
        "gpus_with_engine": sum(len(p.gpus) for p in placements),
    }
