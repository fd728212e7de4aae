"""What the Megatron-based distributed tests need on CPU (megatron-core 0.16.1).

``patch_schedules_for_cpu`` is the backend's own
``nemo_d3s.backends.megatron.cpu_compat.apply_cpu_compat`` (it replaces the pipeline
schedules' ``device="cuda"`` token counter, among the other CUDA hard-coding of the GPT
path); the name stays for the tests that call it.

The schedule also reads two fields that only ``TransformerConfig`` defines
(``calculate_per_token_loss``, ``fine_grained_activation_offloading``); a bare
``ModelParallelConfig`` gets them set to their TransformerConfig defaults (False) by
:func:`schedule_config`.
"""

from __future__ import annotations

from nemo_d3s.backends.megatron.cpu_compat import apply_cpu_compat as patch_schedules_for_cpu

__all__ = ["patch_schedules_for_cpu", "schedule_config"]


def schedule_config(cfg):
    """Give a ModelParallelConfig the TransformerConfig-only fields the schedule reads."""
    for name in ("calculate_per_token_loss", "fine_grained_activation_offloading"):
        if not hasattr(cfg, name):
            setattr(cfg, name, False)
    return cfg
