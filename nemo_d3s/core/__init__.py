"""Pure tensor math of D3S / PODS: no torch.distributed, no Megatron, no I/O.

Modules (each lists its public names in ``__all__``; all of them are re-exported here):

- ``advantages``       group-relative advantages on full groups (ADVANTAGE_ESTIMATORS)
- ``sample_selection`` rollout down-sampling, max-variance subsets (SAMPLE_SELECTORS)
- ``schedules``        (N, K) over training progress (SCHEDULES, DynamicSchedule)
- ``token_selection``  |A| x H token scores and top-K% masks (TOKEN_SELECTORS)
- ``entropy``          chunked full-vocabulary entropy and log-probs
- ``losses``           GRPO / GSPO policy losses with global denominators (POLICY_LOSSES);
                       ``loss_config`` (LossConfig, denominators), ``loss_parts`` (their pieces)
- ``micro_batches``    rows -> micro-batches: fixed row counts or a token budget
- ``presets``          D3SConfig and the papers' named PRESETS
- ``d3s``              the two-stage D3SSelector (re-exports D3SConfig, PRESETS)
- ``registry``, ``checks``  extension-point registry and input validation

Importing this package imports torch and these modules only (tested).
"""

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
