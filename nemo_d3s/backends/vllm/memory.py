"""What a colocated vLLM engine keeps on the GPUs it shares with the trainer, per phase, for
the dry run (pure arithmetic: no torch, no vLLM import).

Generating: ``gpu_memory_utilization`` x the GPU plus the CUDA context and TP communicator its
worker made before measuring (:func:`awake_engine_bytes`), beside the trainer's state only
(its cache is emptied first). Training: a level-2 sleep still holds a CUDA context, TP
communicator buffers and CUDA graphs' pool (assumed sizes for an 80 GB Hopper GPU).
Refitting: awake weights, the staging buffer, the staged bucket, TP shards, and the engine's
bucket copy.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

from nemo_d3s.backends.vllm.expert_parallel import dense_model_refusal
from nemo_d3s.backends.vllm.placement import engine_placement, placement_summary
from nemo_d3s.errors import ConfigError

__all__ = [
    "CUDA_GRAPH_BYTES",
    "awake_engine_bytes",
    "engine_comm_bytes",
    "VLLM_COMM_BYTES",
    "VLLM_CONTEXT_BYTES",
    "HBM_BYTES_PER_S",
    "engine_positions",
    "engine_starts",
    "engine_params_per_gpu",
    "engine_plan",
    "separate_plan",
    "generation_idle",
    "sleeping_engine_bytes",
    "refit_bytes",
]

GB = 10**9
VLLM_CONTEXT_BYTES = int(
    0.6 * GB
)  # a vLLM worker process's CUDA context + cuBLAS workspace (assumed)
VLLM_COMM_BYTES = int(
    0.5 * GB
)  # NCCL buffers + custom all-reduce of vLLM's TP group, TP > 1 (assumed)
CUDA_GRAPH_BYTES = int(1.0 * GB)  # captured CUDA graphs' private pool, kept through sleep (assumed)
# The GPU's memory bandwidth for the decode floor below: an H100 SXM's datasheet figure
# (assumed; an H200's is 4.8e12, which lowers the floor).
HBM_BYTES_PER_S = 3.35e12


def engine_plan(
    engine_ranks: Sequence[int], *, nodes: int, gpus_per_node: int, tensor_parallel_size: int
) -> Dict[str, object]:
    """The runtime's ``engine_placement`` (same ValueErrors) as the dry run records it."""
    if any(not 0 <= r < nodes * gpus_per_node for r in engine_ranks):
        raise ValueError(
            f"engine ranks {list(engine_ranks)} outside the job's {nodes * gpus_per_node} ranks"
        )
    placed = engine_placement(
        engine_ranks, gpus_per_node=gpus_per_node, tensor_parallel_size=tensor_parallel_size
    )
    return dict(placement_summary(placed, gpus_per_node))


def separate_plan(gpus: int, *, gpus_per_node: int, tensor_parallel_size: int) -> Dict[str, object]:
    """``engine_plan``'s record for engines on ``gpus`` GPUs of their own (whole nodes first)."""
    tp = int(tensor_parallel_size)
    per_node = int(gpus_per_node) // tp
    engines = int(gpus) // tp
    nodes = -(-engines // max(per_node, 1))
    counts = {str(n): min(per_node, engines - n * per_node) for n in range(nodes)}
    return {
        "engines": engines,
        "engines_per_node": counts,
        "engine_gpus": {},
        "shards_per_gpu": 1,
        "gpus_with_engine": int(gpus),
        "separate_gpus": int(gpus),
    }


def engine_starts(tp: int, pp: int, engines_per_copy: int = 1) -> List[Tuple[int, int]]:
    """(TP rank, PP stage) of each engine's first rank in a model copy: the copy's ranks in
    ascending order run stage by stage, TP rank within (both of Megatron's orders), cut into
    ``engines_per_copy`` blocks (``megatron.parallel.engine_blocks``)."""
    from nemo_d3s.backends.megatron.parallel import engine_blocks

    blocks = engine_blocks(range(int(tp) * int(pp)), engines_per_copy)
    return [(b[0] % tp, b[0] // tp) for b in blocks]


def engine_positions(
    tp: int, pp: int, vllm_tp: int, *, stage_stride_ranks: int, engines_per_copy: int = 1
) -> List[Tuple[int, int]]:
    """(TP rank, PP stage) positions of a model copy whose GPU carries an engine worker: the
    next ``vllm_tp`` ranks from each of :func:`engine_starts` (past the start's stage only
    where stages are consecutive ranks); ``stage_stride_ranks``: ranks between stages."""
    out = []
    for t0, p0 in engine_starts(tp, pp, engines_per_copy):
        for j in range(int(vllm_tp)):
            t, p = (t0 + j) % tp, p0 + (t0 + j) // tp
            if p == p0 or stage_stride_ranks == tp:
                out.append((t, p))
    return [(t, p) for t, p in out if p < pp]


def engine_comm_bytes(vllm_tp: int, *, nvls_bytes: int = 0) -> int:
    """The engine's TP communicator on each of its GPUs (none at TP 1): its NCCL buffers
    and custom all-reduce, plus NVLink SHARP's buffers where NCCL uses NVLS (``nvls_bytes``)."""
    return VLLM_COMM_BYTES + int(nvls_bytes) if vllm_tp > 1 else 0


def awake_engine_bytes(reserved_bytes: float, vllm_tp: int, *, nvls_bytes: int = 0) -> float:
    """What an awake engine takes on each of its GPUs: vLLM's budget, ``reserved_bytes``
    (utilization x the total CUDA reports: vLLM 0.33 ``v1/worker/utils.py:716-726``), plus
    what its worker made before the memory snapshot that budget is measured from: the CUDA
    context, cuBLAS handles and the TP communicator (``v1/worker/gpu_worker.py:496-545``)."""
    return (
        float(reserved_bytes)
        + VLLM_CONTEXT_BYTES
        + engine_comm_bytes(vllm_tp, nvls_bytes=nvls_bytes)
    )


def sleeping_engine_bytes(vllm_tp: int, *, cuda_graphs: bool, nvls_bytes: int = 0) -> int:
    """What an engine sleeping at level 2 still holds on each of its GPUs."""
    return (
        VLLM_CONTEXT_BYTES
        + engine_comm_bytes(vllm_tp, nvls_bytes=nvls_bytes)
        + (CUDA_GRAPH_BYTES if cuda_graphs else 0)
    )


def refit_bytes(
    *, engine_weight_bytes: float, bucket_bytes: int, largest_tensor_bytes: int, tp: int
) -> Dict[str, float]:
    """Bytes of a refit on an engine GPU beyond the training state and the sleeping engine
    (a bucket is at least the largest tensor)."""
    bucket = max(bucket_bytes, largest_tensor_bytes)
    return {
        "engine_weights": engine_weight_bytes,
        "staging": bucket,
        "held": bucket,
        "gather_shards": largest_tensor_bytes if tp > 1 else 0,
        "engine_copy": bucket,
    }


def generation_idle(
    *,
    gpus_total: int,
    gpus_with_engine: int,
    copy_gpus: int,
    vllm_tp: int,
    weight_bytes_per_gpu: float,
    decode_steps: int,
    cp: int = 1,
    engines_per_copy: int = 1,
) -> Dict[str, object]:
    """The GPUs without an engine, which wait while the engines generate, and why, with a
    floor on the wait: each decode step reads an engine GPU's weights once at
    :data:`HBM_BYTES_PER_S`. ``copy_gpus``: TP x PP, the GPUs an engine is refitted from (at
    context parallelism ``cp`` > 1, each CP rank's group of a copy has its own engines;
    ``engines_per_copy`` engines per group, each starting a block of its GPUs)."""
    idle = int(gpus_total) - int(gpus_with_engine)
    floor_s = int(decode_steps) * float(weight_bytes_per_gpu) / HBM_BYTES_PER_S
    e = int(engines_per_copy)
    if idle <= 0:
        why = "every GPU carries an engine shard"
    else:
        unit = "copy" if int(cp) == 1 else "CP rank's group"
        engines = "one engine" if e == 1 else f"{e} engines"
        head = (
            f"{engines} per model copy: a copy"
            if int(cp) == 1
            else f"{engines} per context-parallel rank's TP x PP group ({cp} per model copy): "
            "a group"
        )
        where = "" if e == 1 else f", each from the first rank of its 1/{e} of the {unit}"
        waiting = copy_gpus - e * min(vllm_tp, copy_gpus // e)
        why = (
            f"{head} spans {copy_gpus} GPUs (TP x PP) and {'its engine' if e == 1 else 'each'} "
            f"{vllm_tp} (an engine spans at most one node{where} and is refitted from its own "
            f"{unit}'s ranks), so {waiting} GPUs of each {unit} wait while it generates "
            f"(model.params.rollout_engines_per_copy={e * 2} would start more engines)"
        )
    return {
        "gpus_idle_in_generation": idle,
        "idle_share_in_generation": idle / max(int(gpus_total), 1),
        "generation_floor_s": floor_s,
        "idle_gpu_seconds_per_step_min": idle * floor_s,
        "idle_why": why,
    }


def engine_params_per_gpu(
    spec: Any, vllm_tp: int, expert_parallel: bool, source: Any = "the model"
) -> float:
    """Parameters on one GPU of a vLLM engine of TP ``vllm_tp``: every tensor sliced over TP,
    or with ``expert_parallel`` the routed experts placed whole, ceil(E / TP) of them on the
    busiest GPU (vLLM's linear placement gives the first E mod TP ranks one more), each
    gated expert 3 H F per layer; the rest sliced over TP. ConfigError for a dense model
    (``source`` names it)."""
    if not expert_parallel:
        return spec.num_params / vllm_tp
    E = int(spec.num_experts or 0)
    if not E:
        raise ConfigError(dense_model_refusal(source))
    experts = spec.num_layers * E * 3 * spec.hidden_size * spec.moe_ffn_hidden_size
    return (spec.num_params - experts) / vllm_tp + experts * math.ceil(E / vllm_tp) / E
