"""benchmarks/compare_presets.py: hand-worked statistics, the table on synthetic runs, and
the harness itself on the smoke experiment (2 presets x 1 seed x 2 steps), rerun to show it
skips finished runs and resumes an interrupted one."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "compare_presets", REPO / "benchmarks" / "compare_presets.py"
)
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)


def test_mean_ci_hand_worked():
    # mean 2, sd 1, n 3: half-width t(0.975, 2) x 1 / sqrt(3) = 4.303 / 1.732 = 2.484
    m, h = cp.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 / math.sqrt(3))
    m, h = cp.mean_ci([5.0])
    assert m == 5.0 and math.isnan(h)
    assert math.isnan(cp.mean_ci([])[0])


def test_bootstrap_ratio():
    # Every seed of the reference took 10, every seed of the other 5: exactly 2x, no spread.
    r = cp.bootstrap_ratio([10.0, 10.0, 10.0], [5.0, 5.0, 5.0])
    assert (r["ratio"], r["lo"], r["hi"], r["valid"]) == (2.0, 2.0, 2.0, 1.0)
    # A variant that never reached the threshold has no ratio.
    assert cp.bootstrap_ratio([10.0], [None, None])["ratio"] is None
    # Seeds that never reached are left out of the mean; the interval covers the point.
    r = cp.bootstrap_ratio([10.0, 20.0], [5.0, None, 15.0])
    assert (
        r["ratio"] == pytest.approx(15.0 / 10.0)
        and r["lo"] <= r["ratio"] <= r["hi"]
        and 0 < r["valid"] < 1
    )


def _run(evals, tokens, wall, grad=1.0):
    curve = [
        {"step": i * 10, "eval": e, "tokens": t, "wall": w}
        for i, (e, t, w) in enumerate(zip(evals, tokens, wall))
    ]
    return {
        "curve": curve,
        "kept_sample_ratio": 0.5,
        "kept_token_ratio": 0.2,
        "kept_adv_var": 2.0,
        "adv_var_all": 1.0,
        "share_nonzero_adv": 1.0,
        "grad_norm": grad,
        "update_tokens_total": tokens[-1],
        "wall_time": wall[-1],
    }


def test_summarize_time_to_threshold():
    runs = {
        # reference: best mean eval 0.8 -> threshold 0.792, reached at step 20 (wall 30, tokens 300)
        "grpo": [_run([0.4, 0.6, 0.8], [0, 150, 300], [0, 15, 30], grad=2.0)] * 2,
        # reaches 0.8 at step 10: wall 10 (3x sooner), tokens 50 (6x fewer)
        "d3s": [_run([0.4, 0.8, 0.8], [0, 50, 100], [0, 10, 20], grad=1.0)] * 2,
        "never": [_run([0.4, 0.5, 0.6], [0, 10, 20], [0, 5, 10])],
    }
    s = cp.summarize(runs, "grpo")
    assert s["threshold"] == pytest.approx(0.792)
    d = s["variants"]["d3s"]
    assert d["time_to_threshold"]["speedup_vs_reference"]["ratio"] == pytest.approx(3.0)
    assert d["tokens_to_threshold"]["speedup_vs_reference"]["ratio"] == pytest.approx(6.0)
    assert d["grad_norm_vs_reference"] == pytest.approx(0.5)
    assert s["variants"]["never"]["time_to_threshold"]["reached"] == 0
    # equal compute: the shortest run trained 10 s; grpo had reached 0.4 + 0.2 x 10/15 by then
    assert s["equal_time"] == 10.0
    assert s["variants"]["grpo"]["eval_at_equal_time"][0] == pytest.approx(0.4 + 0.2 * 10 / 15)
    assert s["variants"]["d3s"]["eval_at_equal_time"][0] == pytest.approx(0.8)
    assert s["variants"]["never"]["eval_at_equal_time"][0] == pytest.approx(0.6)
    assert (
        cp.value_at([{"wall": 0, "eval": 0.1}, {"wall": 4, "eval": 0.5}], 5.0) is None
    )  # past the end
    md = cp.table_md(s)
    assert "| d3s | 2 |" in md and "3.00x [3.00, 3.00] (2/2)" in md and "— (0/1)" in md
    # no seeds recorded: no pairs
    assert s["variants"]["d3s"]["eval_final_minus_reference"]["pairs"] == 0


def test_paired_difference_hand_worked():
    """Seeds pair runs: differences (0.5 - 0.4, 0.7 - 0.5, 0.6 - 0.6) = (0.1, 0.2, 0.0): mean 0.1,
    sd 0.1, half-width 4.303 x 0.1 / sqrt(3). Seed 3 has no reference partner and is left out."""

    def run(seed, final):
        return {**_run([0.3, final], [0, 10], [0, 5]), "seed": seed}

    ref = [run(0, 0.4), run(1, 0.5), run(2, 0.6)]
    other = [run(0, 0.5), run(1, 0.7), run(2, 0.6), run(3, 0.9)]
    d = cp.paired_difference(other, ref)
    assert d["pairs"] == 3 and d["mean"] == pytest.approx(0.1)
    assert d["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    md = cp.table_md(cp.summarize({"grpo": ref, "d3s": other}, "grpo"))
    assert (
        "| d3s | 4 | 0.675 ± " in md and f"| +0.100 ± {4.303 * 0.1 / math.sqrt(3):.3f} (3) |" in md
    )
    assert "| grpo | 3 | 0.500 ± " in md and "| +0.000 ± 0.000 (3) |" in md


@pytest.mark.slow
def test_harness_on_the_smoke_experiment(tmp_path):
    out = tmp_path / "cmp"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "compare_presets.py"),
        "--presets",
        "grpo,d3s",
        "--seeds",
        "1",
        "--out",
        str(out),
        "--",
        "experiment=smoke",
        "trainer.steps=2",
        "trainer.eval_every=1",
        "task.eval_size=4",
        "trainer.save_every=1",
        "trainer.export_hf=false",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    table = json.loads((out / "table.json").read_text())
    assert set(table["variants"]) == {"grpo", "d3s"} and table["threshold"] is not None
    assert (out / "curves.png").stat().st_size > 0 and "| d3s | 1 |" in (
        out / "table.md"
    ).read_text()
    done = out / "runs" / "d3s_s0" / "summary.json"
    first = done.read_text()

    # Rerun: both finished, nothing runs. Then drop one summary: that run resumes from its
    # final checkpoint (no step is trained twice) and the metrics keep their two rows.
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert "2 already finished; 0 to run" in r.stdout
    (out / "runs" / "grpo_s0" / "summary.json").unlink()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0 and "1 to run" in r.stdout, r.stdout + r.stderr
    assert "resume=true" in (out / "logs" / "grpo_s0.log").read_text()
    assert len(cp.read_jsonl(out / "runs" / "grpo_s0" / "metrics.jsonl")) == 2
    assert done.read_text() == first


def test_load_run_leaves_evaluation_out_of_wall_time(tmp_path):
    # Evals at steps 0, 2 and 4 take 5 s each and run after the step's row is written, so the
    # trainer's wall_time at step 4 (31 s) holds the evals at 0 and 2: 31 - 10 = 21 s of training.
    rows = [
        {
            "step": s,
            "wall_time": w,
            "update_tokens_total": 10.0 * s,
            "time_step": 5.0,
            "time_rollout": 4.0,
            "reward_mean": 0.5,
            "grad_norm": 1.0,
        }
        for s, w in ((1, 10.0), (2, 15.0), (3, 25.0), (4, 31.0))
    ]
    evals = [
        {"step": s, "eval_reward_mean": r, "time_eval": 5.0}
        for s, r in ((0, 0.1), (2, 0.3), (4, 0.6))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    run = cp.load_run(tmp_path)
    assert [(p["step"], p["wall"], p["tokens"]) for p in run["curve"]] == [
        (0, 0.0, 0.0),
        (2, 10.0, 20.0),
        (4, 21.0, 40.0),
    ]
    assert (
        run["wall_time"] == 21.0
        and run["generation_share"] == pytest.approx(0.8)
        and run["step_time"] == 5.0
    )


def test_report_only_reads_the_seed_range(tmp_path):
    """--first-seed 1 --seeds 2 reports seeds 1 and 2 only (e.g. the runs of one session)."""
    for seed, final in ((0, 0.9), (1, 0.5), (2, 0.7)):
        d = tmp_path / "runs" / f"grpo_s{seed}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(
            json.dumps(
                {
                    "step": 2,
                    "wall_time": 4.0,
                    "time_step": 2.0,
                    "time_rollout": 1.0,
                    "update_tokens_total": 8.0,
                }
            )
            + "\n"
        )
        (d / "eval.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "eval_reward_mean": r, "time_eval": 0.0}) + "\n"
                for s, r in ((0, 0.3), (2, final))
            )
        )
        (d / "summary.json").write_text("{}")
    assert (
        cp.main(
            [
                "--report-only",
                "--presets",
                "grpo",
                "--first-seed",
                "1",
                "--seeds",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    row = json.loads((tmp_path / "table.json").read_text())["variants"]["grpo"]
    assert row["seeds"] == 2 and row["eval_final"][0] == pytest.approx(0.6)
