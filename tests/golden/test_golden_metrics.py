"""A fresh 3-step run at each layout the tests use equals its committed golden metrics
(tests/golden/<layout>.jsonl; see golden.py for the tolerance and how to regenerate)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import golden  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return golden.make_model(tmp_path_factory.mktemp("golden") / "model")


def _check(name, model, tmp_path):
    fresh = golden.run_layout(name, model, tmp_path / name)
    want = golden.read_golden(name)
    assert any(r.get("optimizer_steps", 0) > 0 for r in want), (
        "golden run trained nothing: the check would be vacuous"
    )
    diffs = golden.compare(want, fresh, name)
    assert not diffs, (
        "metrics moved from the golden run; if that is intended, regenerate with "
        f"`python tests/golden/golden.py --write {name}` and say why in the commit:\n"
        + "\n".join(diffs[:30])
    )


def test_single_process_matches_golden(model, tmp_path):
    _check("single", model, tmp_path)


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
@pytest.mark.distributed
def test_dp2_matches_golden(model, tmp_path):
    _check("dp2", model, tmp_path)


@pytest.mark.slow
def test_packed_matches_golden(model, tmp_path):
    _check("packed", model, tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_packed_matches_golden(model, tmp_path):
    _check("dp2_packed", model, tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp2", "tp2_pp2", "tp2_packed", "cp2"])
def test_megatron_layouts_match_golden(name, model, tmp_path):
    _check(name, model, tmp_path)


def test_golden_layouts_agree_with_each_other():
    """The Llama's golden files are one run at every layout: layout invariance, written down
    (the mixture-of-experts model's, another model, are left out)."""
    ref = golden.read_golden("single")
    for name in set(golden.LAYOUTS) - golden.MOE_LAYOUTS:
        assert golden.compare(ref, golden.read_golden(name), name) == []


def test_compare_catches_a_moved_metric():
    rows = golden.read_golden("single")
    moved = [dict(r) for r in rows]
    moved[1]["loss"] = rows[1]["loss"] * (1 + 1e-3)
    moved[2]["n_kept_tokens"] = rows[2]["n_kept_tokens"] + 1
    del moved[0]["grad_norm"]
    diffs = golden.compare(rows, moved, "x")
    assert (
        len(diffs) == 3
        and any("loss" in d for d in diffs)
        and any("n_kept_tokens" in d for d in diffs)
    )
    assert any("grad_norm' missing" in d for d in diffs)
    near = [dict(r, loss=r["loss"] * (1 + 1e-6)) for r in rows]
    assert golden.compare(rows, near, "x") == []
    assert golden.compare(rows, rows[:2], "x") == ["x: 2 steps, golden has 3"]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return golden.make_model(tmp_path_factory.mktemp("golden_moe") / "model", moe=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_layout_matches_golden(moe_model, tmp_path):
    _check("ep2", moe_model, tmp_path)
