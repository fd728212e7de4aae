"""Checkpoint conversion (``nemo-d3s-convert``): Hugging Face <-> Megatron sharded <-> NeMo 2 /
Megatron-LM checkpoints on the weight table of ``nemo_d3s.formats``; every command reads any
checkpoint this package reads.

    hf_to_megatron("Qwen2.5-0.5B", "qwen-tp2", tp=2, pp=1)
    megatron_to_hf("runs/x/checkpoints/step_000100", "qwen-d3s", hf_config="Qwen2.5-0.5B")
    print(verify("qwen-d3s", "runs/x/checkpoints/step_000100", hf_config="Qwen2.5-0.5B").verdict())
"""

from nemo_d3s.convert.core import hf_to_megatron, megatron_to_hf, megatron_to_nemo
from nemo_d3s.convert.sources import CheckpointSource, open_checkpoint
from nemo_d3s.convert.verify_logits import VerifyResult, verify

__all__ = [
    "CheckpointSource",
    "VerifyResult",
    "hf_to_megatron",
    "megatron_to_hf",
    "megatron_to_nemo",
    "open_checkpoint",
    "verify",
]
