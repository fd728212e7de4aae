"""Make ``_launch`` (the rank launcher) importable from the distributed tests under any
pytest import mode; the spawned ranks inherit this ``sys.path``."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
