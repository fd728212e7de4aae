"""Pure tensor math of D3S / PODS (advantages, sample and token selection, schedules, entropy,
losses, micro-batches, presets, the two-stage selector): no torch.distributed, no Megatron, no I/O.
Re-exports every module's ``__all__``; importing it imports torch and these modules only."""

from nemo_d3s.core import (
    advantages,
    checks,  # noqa: F401  (a public submodule)
    d3s,
    entropy,
    losses,
    micro_batches,
    presets,  # noqa: F401  (a public submodule)
    registry,  # noqa: F401  (a public submodule)
    sample_selection,
    schedules,
    token_selection,
)
from nemo_d3s.core.advantages import *  # noqa: F401,F403
from nemo_d3s.core.d3s import *  # noqa: F401,F403
from nemo_d3s.core.entropy import *  # noqa: F401,F403
from nemo_d3s.core.losses import *  # noqa: F401,F403
from nemo_d3s.core.micro_batches import *  # noqa: F401,F403
from nemo_d3s.core.registry import Registry
from nemo_d3s.core.sample_selection import *  # noqa: F401,F403
from nemo_d3s.core.schedules import *  # noqa: F401,F403
from nemo_d3s.core.token_selection import *  # noqa: F401,F403

_MODULES = (
    advantages,
    sample_selection,
    schedules,
    token_selection,
    entropy,
    losses,
    micro_batches,
    d3s,
)

__all__ = ["Registry"] + [name for module in _MODULES for name in module.__all__]
