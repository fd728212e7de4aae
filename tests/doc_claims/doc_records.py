"""What the documents' figure checks share: where the records are (``benchmarks/results/``, one
``RESULTS`` that a test may point elsewhere) and how a figure is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
GB, MIB, GIB = 1e9, 2**20, 2**30


def results() -> Path:
    """The records' folder (read at each call, so a test can point ``RESULTS`` elsewhere)."""
    return RESULTS


def record(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def asserted(path: str, code: str, text: str) -> str:
    """``text`` while the test file ``path`` still asserts ``code`` (the assertion that makes
    the figure true), else a text no document holds, naming what went missing."""
    src = (REPO / path).read_text()
    return text if code in src else f"{text} [{path} no longer has {code!r}]"


def sci(x: float) -> str:
    """3.03e-05 -> "3.0e-5", as the prose writes it."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def median(xs: List[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2
