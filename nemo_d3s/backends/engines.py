"""The rollout-engine registry: ``rollout.engine`` -> a factory ``fn(policy, settings) ->
RolloutEngine``. ``hf`` is the policy's own engine (``policy_own``: its settings are ignored);
``vllm`` builds a vLLM engine from the policy (imported only when chosen), placed by the
policy (``Policy.place_rollout_engine``) after a check that no two engines of the job would
share a GPU (``check_gpu_placement``), and refitted at once (so vLLM starts on dummy weights)."""

from __future__ import annotations

from typing import Any, Mapping

from nemo_d3s.backends.base import Policy, RolloutEngine
from nemo_d3s.core.registry import Registry

__all__ = ["ROLLOUT_ENGINES", "build_rollout_engine", "check_gpu_placement"]

ROLLOUT_ENGINES: Registry = Registry(
    "rollout engine", "fn(policy: Policy, settings: Mapping) -> RolloutEngine", policy_own=False
)


@ROLLOUT_ENGINES.register("hf", policy_own=True)
def _policy_engine(policy: Policy, settings: Mapping[str, Any]) -> RolloutEngine:
    return policy.rollout_engine


@ROLLOUT_ENGINES.register("vllm")
def _vllm_engine(policy: Policy, settings: Mapping[str, Any]) -> RolloutEngine:
    import dataclasses

    from nemo_d3s.backends.vllm.engine import VLLMEngine, VLLMEngineConfig

    known = {f.name for f in dataclasses.fields(VLLMEngineConfig)}
    # build_rollout_engine refits right after placing it: vLLM need not read the checkpoint
    return VLLMEngine(
        policy,
        VLLMEngineConfig(**{k: v for k, v in settings.items() if k in known}),
        refit_follows=True,
    )


def check_gpu_placement(policy: Policy, settings: Mapping[str, Any]) -> None:
    """On CUDA, before any engine starts: the engines of the job (one per rank the policy
    names, ``rollout.tensor_parallel_size`` GPUs each from that rank's GPU on) share no GPU
    and stay inside their node (``vllm.placement.engine_placement``). Every rank computes the
    same answer from the launcher's variables: the same error everywhere, no collective."""
    import os

    import torch

    if not torch.cuda.is_available():
        return
    import torch.distributed as dist

    from nemo_d3s.backends.vllm.placement import engine_placement

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and not os.environ.get("LOCAL_WORLD_SIZE"):
        # not launched by torchrun: ranks per node unknown (each engine still takes its own GPUs)
        return
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    engine_placement(
        policy.rollout_engine_ranks(world),
        gpus_per_node=torch.cuda.device_count(),
        ranks_per_node=max(ranks_per_node, 1),
        tensor_parallel_size=int(settings.get("tensor_parallel_size", 1) or 1),
    )


def build_rollout_engine(name: str, policy: Policy, settings: Mapping[str, Any]) -> RolloutEngine:
    """The engine ``name``; one the policy does not own is placed by the policy
    (``Policy.place_rollout_engine``: every rank, or one rank per model-parallel group)."""
    factory = ROLLOUT_ENGINES.get(name)
    if ROLLOUT_ENGINES.prop(name, "policy_own"):
        return factory(policy, settings)
    if name == "vllm":
        check_gpu_placement(policy, settings)
    engine = policy.place_rollout_engine(lambda: factory(policy, settings))
    engine.sync_weights(policy)  # collective: it may have loaded other weights than the policy's
    return engine
