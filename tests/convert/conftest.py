"""The nemo-toolkit tests (marker ``nemo``, ``test_nemo_toolkit.py``) need a Python with
nemo-toolkit 2.x and its LLM collection: this one, or the interpreter named by
``NEMO_D3S_NEMO_PYTHON`` (NeMo pins transformers 4.57 and megatron-core < 0.16, so it
usually lives in its own virtual environment; docs/scaling.md "Converting checkpoints" has the
recipe). Where neither exists they are not collected, like the vLLM tests."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _nemo_env import nemo_python  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "nemo: runs nemo-toolkit 2.x (NeMo's HF importer/exporter) for real"
    )


collect_ignore = [] if nemo_python() else ["test_nemo_toolkit.py"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(a tiny Llama HF folder, its hf-to-megatron conversion at TP2 x PP2)."""
    from _models import tiny

    from nemo_d3s.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("made")
    src = tiny(root / "llama", "llama")
    ck = hf_to_megatron(src, root / "ck", tp=2, pp=2, progress=False)
    return src, ck
