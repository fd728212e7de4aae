"""The one CPU shim the Megatron-based tests need (megatron-core 0.16.1).

``initialize_model_parallel``, ``ModelParallelConfig`` and the tensor-parallel layers
(``VocabParallelEmbedding``, ``ColumnParallelLinear``, ``RowParallelLinear`` with
``use_cpu_initialization=True`` and no sequence parallelism) run on gloo/CPU unchanged.
``forward_backward_no_pipelining`` however allocates its token counter with
``torch.zeros([], dtype=torch.int, device="cuda")``, which fails on a CPU-only build. We
want the real schedule in the gradient test (its per-micro-batch loss scaling is exactly
what the normaliser must compensate), so inside the test ranks only, the schedules
module's ``torch`` is replaced by a proxy whose ``zeros`` maps device "cuda" to "cpu";
everything else is torch itself. Nothing in ``nemo_d3s`` imports Megatron or this shim.

The schedule also reads two fields that only ``TransformerConfig`` defines
(``calculate_per_token_loss``, ``fine_grained_activation_offloading``); a bare
``ModelParallelConfig`` gets them set to their TransformerConfig defaults (False) by
:func:`schedule_config`.
"""

from __future__ import annotations

import torch


class _CpuTorch:
    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


def patch_schedules_for_cpu() -> None:
    """Make ``megatron.core.pipeline_parallel.schedules`` allocate on CPU (idempotent)."""
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _CpuTorch):
        schedules.torch = _CpuTorch()


def schedule_config(cfg):
    """Give a ModelParallelConfig the TransformerConfig-only fields the schedule reads."""
    for name in ("calculate_per_token_loss", "fine_grained_activation_offloading"):
        if not hasattr(cfg, name):
            setattr(cfg, name, False)
    return cfg
