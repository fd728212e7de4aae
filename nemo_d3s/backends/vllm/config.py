"""The vLLM engine's settings (no torch or vLLM import: the run-config schema extends it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_d3s.core.checks import is_count, is_number

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
        log_file: where the engine's own processes write their output (a multi-process
        engine): null = ``vllm_engine.log`` in the run directory (``vllm_engine_rank<R>.log``
        on rank R > 0), "-" = the job's terminal. Its errors are named in the trainer's.
    routed_experts: return the experts each token was routed to (a mixture of experts; vLLM's
        ``enable_return_routed_experts``, its Model Runner V2 on CUDA), so each step logs
        ``rollout_routing_mismatch`` and ``algorithm.router_replay=rollout`` can replay them:
        null = for a mixture of experts on a GPU; true = required (an error for a dense model
        or the CPU build, which cannot); false = never (``backends/vllm/routing.py``).
    expert_parallel: a mixture of experts' experts placed whole over the engine's
        ``tensor_parallel_size`` GPUs (vLLM's ``enable_expert_parallel``: EP = the engine's TP,
        linear placement, attention still TP) instead of each expert sliced over them; needs
        a GPU (``backends/vllm/expert_parallel.py`` says why) and a MoE model. The refit is the
        same.
    """

    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enforce_eager: Optional[bool] = None
    sleep: bool = True
    max_model_len: Optional[int] = None
    cpu_kv_cache_gb: int = 2
    refit_bucket_mb: float = 512
    log_file: Optional[str] = None
    routed_experts: Optional[bool] = None
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        # The run config's rollout section is judged here too (RolloutConfig builds one).
        g = self.gpu_memory_utilization
        if not (is_number(g) and 0 < g <= 1):
            raise ValueError(f"gpu_memory_utilization={g!r}: must be in (0, 1]")
        if not is_count(self.tensor_parallel_size, 1):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size!r}: must be an integer >= 1"
            )
        if self.max_model_len is not None and not is_count(self.max_model_len, 1):
            raise ValueError(
                f"max_model_len={self.max_model_len!r}: must be an integer >= 1 or null "
                "(the model's)"
            )
        if not is_count(self.cpu_kv_cache_gb, 1):
            raise ValueError(
                f"cpu_kv_cache_gb={self.cpu_kv_cache_gb!r}: must be an integer >= 1 (GiB)"
            )
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(
                f"enforce_eager={self.enforce_eager!r}: must be true, false or null (CUDA "
                "graphs on a GPU)"
            )
        if self.log_file is not None and not (isinstance(self.log_file, str) and self.log_file):
            raise ValueError(
                f"log_file={self.log_file!r}: must be a file path, '-' (the terminal) or null "
                "(vllm_engine.log in the run directory)"
            )
        if self.routed_experts is not None and not isinstance(self.routed_experts, bool):
            raise ValueError(
                f"routed_experts={self.routed_experts!r}: must be true, false or null (for a "
                "mixture of experts on a GPU)"
            )
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(
                f"expert_parallel={self.expert_parallel!r}: must be true or false (vLLM's "
                "enable_expert_parallel)"
            )
        b = self.refit_bucket_mb
        if not (is_number(b) and b > 0):
            raise ValueError(
                f"refit_bucket_mb={b!r}: must be > 0 (MiB of weights per refit bucket)"
            )
