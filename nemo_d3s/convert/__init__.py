"""Checkpoint conversion (``nemo-d3s-convert``): Hugging Face <-> Megatron sharded
checkpoints on the Megatron backend's weight table. See :mod:`nemo_d3s.convert.core`.

    from nemo_d3s.convert import hf_to_megatron, megatron_to_hf, verify

    hf_to_megatron("Qwen2.5-0.5B", "qwen-tp2", tp=2, pp=1)
    megatron_to_hf("runs/x/checkpoints/step_000100", "qwen-d3s", hf_config="Qwen2.5-0.5B")
    print(verify("qwen-d3s", "runs/x/checkpoints/step_000100", hf_config="Qwen2.5-0.5B").verdict())
"""

from nemo_d3s.convert.core import (
    CheckpointSource,
    VerifyResult,
    hf_to_megatron,
    megatron_to_hf,
    open_checkpoint,
    verify,
)

__all__ = ["CheckpointSource", "VerifyResult", "hf_to_megatron", "megatron_to_hf", "open_checkpoint", "verify"]
