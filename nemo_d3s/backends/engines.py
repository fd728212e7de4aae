"""The rollout-engine registry: ``rollout.engine`` -> a factory ``fn(policy, settings) ->
RolloutEngine``. ``hf`` is the policy's own engine (its settings are ignored); ``vllm`` builds
a vLLM engine from the policy (imported only when chosen)."""

from __future__ import annotations

from typing import Any, Mapping

from nemo_d3s.backends.base import Policy, RolloutEngine
from nemo_d3s.core.registry import Registry

__all__ = ["ROLLOUT_ENGINES", "build_rollout_engine"]

ROLLOUT_ENGINES: Registry = Registry("rollout engine", "fn(policy: Policy, settings: Mapping) -> RolloutEngine")


@ROLLOUT_ENGINES.register("hf")
def _policy_engine(policy: Policy, settings: Mapping[str, Any]) -> RolloutEngine:
    return policy.rollout_engine


@ROLLOUT_ENGINES.register("vllm")
def _vllm_engine(policy: Policy, settings: Mapping[str, Any]) -> RolloutEngine:
    import dataclasses

    from nemo_d3s.backends.vllm.engine import VLLMEngine, VLLMEngineConfig

    known = {f.name for f in dataclasses.fields(VLLMEngineConfig)}
    return VLLMEngine(policy, VLLMEngineConfig(**{k: v for k, v in settings.items() if k in known}))


def build_rollout_engine(name: str, policy: Policy, settings: Mapping[str, Any]) -> RolloutEngine:
    return ROLLOUT_ENGINES.get(name)(policy, settings)
