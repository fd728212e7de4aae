"""The dry-run table in docs/scaling.md is what the dry run prints: every figure of every
recipe's row equals the plan of that recipe at its cluster shape (GB = 1e9 bytes, one
decimal), at the busiest GPU, so a change to the memory model or a recipe cannot leave the
table stale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_d3s.dry_run import JobShape, plan
from nemo_d3s.train import compose_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"
GB = 1e9
COLUMNS = [
    "weights",
    "grads",
    "optimizer",
    "activations",
    "vllm",
    "train_peak",
    "refit_peak",
    "generation_peak",
]


def _rows():
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(
            r"\| (\w+) \((\d+) x (\d+)\)[^|]*\|[^|]*\| ([\d.]+)B \|(.*)\| (fits|does not fit) \|$",
            line,
        )
        if m:
            cells = [c.strip() for c in m.group(5).split("|")]
            figures = [float(c.split()[0]) for c in cells]
            rows[m.group(1)] = (
                int(m.group(2)),
                int(m.group(3)),
                float(m.group(4)),
                figures,
                m.group(6),
            )
    return rows


ROWS = _rows()


def test_the_table_lists_every_vllm_recipe():
    assert set(ROWS) == {
        "llama3_8b",
        "qwen25_math_7b",
        "llama3_70b",
        "qwen25_72b",
        "llama3_70b_long",
        "qwen3_32b",
    }


@pytest.mark.parametrize("name", sorted(ROWS))
def test_row_equals_the_dry_run(name, tmp_path):
    nodes, gpus, params_b, figures, verdict = ROWS[name]
    report = plan(
        compose_config([f"experiment={name}", f"output_dir={tmp_path}"]),
        JobShape(nodes, gpus, "test"),
    )
    busiest = max(report["positions"], key=lambda p: p["peak_bytes"])
    assert busiest["peak_bytes"] == report["worst"]["peak_bytes"]
    t = busiest["terms_bytes"]
    got = [
        t["weights"],
        t["grads"],
        t["optimizer"],
        t["activations"],
        t["vllm"],
        busiest["train_peak_bytes"],
        busiest["refit_peak_bytes"],
        busiest["generation_peak_bytes"],
    ]
    assert [round(g / GB, 1) for g in got] == figures, dict(zip(COLUMNS, got))
    assert round(busiest["params"] / 1e9, 2) == params_b
    assert (verdict == "fits") == report["fits"]
