"""nemo_d3s: D3S / PODS rollout- and token-level down-sampling for GRPO and GSPO. Layers, imports
pointing down: ``core`` (pure tensor math), ``distributed`` (over explicit process groups),
``backends`` (the only model-framework imports), ``trainer`` / ``tasks``."""

__version__ = "0.1.0"
