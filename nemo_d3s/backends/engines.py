"""The rollout-engine registry: ``rollout.engine`` -> a factory ``fn(policy, settings) ->
RolloutEngine``. ``hf`` is the policy's own engine (``policy_own``: its settings are ignored);
``vllm`` builds a vLLM engine from the policy (imported only when chosen), placed by the
policy (``Policy.place_rollout_engine``)."""

from __future__ import annotations

from typing import Any, Mapping

from nemo_d3s.backends.base import Policy, RolloutEngine
from nemo_d3s.core.registry import Registry

__all__ = ["ROLLOUT_ENGINES", "build_rollout_engine"]

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
    return VLLMEngine(policy, VLLMEngineConfig(**{k: v for k, v in settings.items() if k in known}))


def build_rollout_engine(name: str, policy: Policy, settings: Mapping[str, Any]) -> RolloutEngine:
    """The engine ``name``; one the policy does not own is placed by the policy
    (``Policy.place_rollout_engine``: every rank, or one rank per model-parallel group)."""
    factory = ROLLOUT_ENGINES.get(name)
    if ROLLOUT_ENGINES.prop(name, "policy_own"):
        return factory(policy, settings)
    engine = policy.place_rollout_engine(lambda: factory(policy, settings))
    engine.sync_weights(policy)  # collective: it may have loaded other weights than the policy's
    return engine
