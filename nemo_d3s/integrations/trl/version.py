"""The TRL releases the plugin was tested on, and the one-line refusal of the others.

The plugin overrides ``GRPOTrainer`` internals (method names, the generation batch's keys;
see ``trainer.py``), which TRL moves between minor releases without notice. Tested:
trl 1.16.0 (tests/integrations/test_trl_*.py in the venv of ``.ci/run``'s TRL leg).
"""

from __future__ import annotations

import os
import re
from typing import Tuple

from nemo_d3s.errors import RunError

__all__ = ["TESTED_TRL", "ANY_TRL_ENV", "check_trl_version"]

# [lowest tested, first untested) as (major, minor)
TESTED_TRL: Tuple[Tuple[int, int], Tuple[int, int]] = ((1, 16), (1, 17))
ANY_TRL_ENV = "NEMO_D3S_TRL_ANY_VERSION"


def _major_minor(version: str) -> Tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if not m:
        raise RunError(f"trl: cannot read its version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_trl_version(version: str) -> None:
    """Refuse a TRL outside ``TESTED_TRL`` (one line, RunError) unless
    ``$NEMO_D3S_TRL_ANY_VERSION=1``."""
    if os.environ.get(ANY_TRL_ENV) == "1":
        return
    lo, hi = TESTED_TRL
    if not lo <= _major_minor(version) < hi:
        rng = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
        raise RunError(
            f"trl {version}: nemo_d3s.integrations.trl hooks GRPOTrainer internals tested on "
            f'trl{rng} only; install "trl{rng}" (pip install -e ".[trl]") '
            f"or set {ANY_TRL_ENV}=1 to try it"
        )
