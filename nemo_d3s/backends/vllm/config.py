"""The vLLM engine's settings (no torch or vLLM import: the run-config schema extends it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["VLLMEngineConfig"]


@dataclass
class VLLMEngineConfig:
    """Settings of the vLLM engine (``rollout=vllm``; each key ``rollout.<key>``).

    gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache) while
        awake; ignored on CPU. tensor_parallel_size: vLLM's own TP (GPUs per engine).
    dtype: "auto" (the policy's; bf16 on CUDA for an fp32 policy), "float32", "bfloat16",
        "float16". enforce_eager: True = no CUDA graphs (faster start, slower decode); None =
        CUDA graphs on a GPU, eager on the CPU build. sleep: on GPU, drop the engine's weights
        and KV cache while the policy trains (``enable_sleep_mode``, level 2: the refit brings
        the weights back). max_model_len: prompt + response limit (None = the model's).
        cpu_kv_cache_gb: the CPU build's KV-cache size (``VLLM_CPU_KVCACHE_SPACE``).
        refit_bucket_mb: MiB of weights moved per refit bucket (the staging buffer on each GPU).
    """

    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enforce_eager: Optional[bool] = None
    sleep: bool = True
    max_model_len: Optional[int] = None
    cpu_kv_cache_gb: int = 2
    refit_bucket_mb: float = 512
