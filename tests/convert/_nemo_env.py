"""Which Python runs NeMo's side of the nemo-toolkit tests (see conftest.py)."""

import importlib.util
import os
import sys


def nemo_python():
    """``NEMO_D3S_NEMO_PYTHON`` when set (an interpreter with nemo-toolkit 2.x), else this
    interpreter when it has nemo-toolkit, else None."""
    env = os.environ.get("NEMO_D3S_NEMO_PYTHON")
    if env:
        return env if os.access(env, os.X_OK) else None
    if (
        importlib.util.find_spec("nemo") is not None
        and importlib.util.find_spec("lightning") is not None
    ):
        return sys.executable
    return None
