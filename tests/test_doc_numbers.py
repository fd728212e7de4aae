"""The figures of the README and docs/ are the committed records' (rendered by
tests/doc_claims/ from benchmarks/results/, the code's constants and the tests' assertions),
and the main job's record script works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "doc_claims"))
import doc_numbers  # noqa: E402
import doc_records  # noqa: E402
from _limits import WAIT_S  # noqa: E402


def test_every_quoted_figure_is_the_records():
    missing = doc_numbers.check()
    assert not missing, "\n".join(
        f"{doc}: {text}" for doc, items in missing.items() for text in items
    )


def test_a_record_that_changes_is_caught(tmp_path, monkeypatch):
    """The check is not vacuous: one changed number in a record, and the text no longer has it."""
    results = tmp_path / "results"
    shutil.copytree(doc_records.RESULTS, results)
    table = json.loads((results / "evidence" / "table.json").read_text())
    table["variants"]["d3s"]["eval_final"][0] += 0.01
    (results / "evidence" / "table.json").write_text(json.dumps(table))
    main = json.loads((results / "cpu_default" / "main_job.json").read_text())
    main["s_per_step"]["median"] += 3
    (results / "cpu_default" / "main_job.json").write_text(json.dumps(main))
    vllm = json.loads((results / "bench_vllm_rollouts.json").read_text())
    vllm["generation"]["engine_start_s"] += 10
    (results / "bench_vllm_rollouts.json").write_text(json.dumps(vllm))
    rows = (results / "cpu_default" / "metrics.jsonl").read_text().splitlines()
    row = json.loads(rows[10])
    assert row["step"] == 11
    row["kept_token_ratio"] = 0.5
    rows[10] = json.dumps(row)
    (results / "cpu_default" / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    check = (results / "reward_check" / "metrics.jsonl").read_text().splitlines()
    row = json.loads(check[1])
    row["update_tokens"] = 255.0
    check[1] = json.dumps(row)
    (results / "reward_check" / "metrics.jsonl").write_text("\n".join(check) + "\n")
    monkeypatch.setattr(doc_records, "RESULTS", results)
    missing = doc_numbers.check()
    assert any(t.startswith("Engine start 23 s") for t in missing.get("docs/scaling.md", []))
    assert any("tok=0.50]" in t for t in missing.get("README.md", [])), missing
    assert "| 2 | 0.006 | 0.2 | 1 of 4 | 255 tokens |" in missing.get("README.md", []), missing
    assert any(t.startswith("| `d3s` | 5 | 0.495") for t in missing.get("docs/evidence.md", [])), (
        missing
    )
    assert any("**21 s per step**" in t for t in missing.get("README.md", [])), missing


@pytest.mark.slow  # whole programs (docs/ci.md)
def test_record_main_job_runs_and_measures(tmp_path):
    out = tmp_path / "rec.json"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "record_main_job.py"),
            "run",
            "--out",
            str(out),
            "--",
            "experiment=smoke",
            "trainer.steps=2",
            "trainer.save_every=2",
            "task.eval_size=4",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert (
        rec["steps"] == 2
        and 0 < rec["s_per_step"]["min"] <= rec["s_per_step"]["median"] <= rec["s_per_step"]["max"]
    )
    assert rec["peak_rss_bytes"] > 50 * 2**20  # a Python process with torch loaded
    assert (
        rec["disk_bytes"]["checkpoints_kept"] == 1
        and 0 < rec["disk_bytes"]["one_checkpoint"] < rec["disk_bytes"]["total"]
    )
    assert rec["disk_bytes"]["hf_export"] > 0 and rec["machine"]["cpu_count"] >= 1
    assert not (tmp_path / "rec_run").exists()  # the run folder is removed after measuring
