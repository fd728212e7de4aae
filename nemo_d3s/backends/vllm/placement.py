"""Which GPUs each vLLM engine gets (pure arithmetic: no torch, no vLLM import).

vLLM binds its workers to ``cuda:0..TP-1`` of what it sees (vllm 0.33
``v1/executor/uniproc_executor.py:86-88``, ``multiproc_executor.py:205-226``,
``v1/worker/gpu_worker.py:454, 492-496``), so the engine of local rank L is started with the
node's devices L..L+TP-1 visible: the GPUs of the trainer ranks it is refitted from. No GPU
may carry two engines; every rank computes the same placement without a collective.
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
    """The node's devices as this process names them: ``CUDA_VISIBLE_DEVICES`` or 0..n-1."""
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
    """``CUDA_VISIBLE_DEVICES`` entries of local rank ``local_rank``'s engine: TP devices from
    there on; ValueError when they run past the node."""
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
    """One engine: its building rank, node, local rank and local GPU indices."""

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
    """Where every engine of a job runs (``engine_ranks`` build one; rank i of a node trains
    on its GPU i). ValueError naming both when two engines would share a GPU (each would
    count the other's memory as its own) or one runs past its node."""
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
    """JSON-able record of a placement for the dry run."""
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
