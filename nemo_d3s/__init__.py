"""nemo_d3s: D3S / PODS rollout- and token-level down-sampling for GRPO and GSPO.

Layers, imports only pointing down:

- ``nemo_d3s.core``: pure tensor math (advantages, selection, schedules, losses, entropy).
- ``nemo_d3s.distributed``: the same math over explicit process groups.
- ``nemo_d3s.backends``: the only code that imports a model framework.
- ``nemo_d3s.trainer`` / ``nemo_d3s.tasks``: the backend-agnostic GRPO loop and its tasks.
"""

__version__ = "0.1.0"
