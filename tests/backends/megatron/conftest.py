"""Shared fixtures of the Megatron backend tests."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tiny_hf import make_tiny_hf  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"llama": untied GQA Llama folder, "qwen2": tied Qwen2 folder with q/k/v bias,
    "qwen3": untied Qwen3 folder (q/k norms, head_dim 16 != hidden / heads)}."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {
        "llama": str(make_tiny_hf(root / "llama", "llama", tied=False)),
        "qwen2": str(make_tiny_hf(root / "qwen2", "qwen2", tied=True)),
        "qwen3": str(make_tiny_hf(root / "qwen3", "qwen3", tied=False)),
    }
