"""benchmarks/vs_trl.py: the report on hand-made race folders (no TRL needed: budgets,
thresholds, crossings between evals, the budget cut-off, overlap detection, the verdicts), the
docs/evidence.md section as the record renders it, and a smoke of the whole race on the tiny
model (marker ``trl``: needs trl; CI's TRL leg), which checks what a run records, never how
long it took."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import vs_trl  # noqa: E402
import vs_trl_report as report  # noqa: E402
from compare_presets import mean_ci  # noqa: E402
from vs_trl_arms import ARMS, PHASES, REFERENCE, read_rows  # noqa: E402
from _limits import WAIT_S  # noqa: E402


def _arm(
    root: Path, name: str, seed: int, evals, cpu: float, wall: float, tokens=10.0, stop="budget",
    **extra,
):  # fmt: skip
    """An arm's records: len(steps) = the last eval's step, each step ``cpu`` / ``wall`` s;
    ``extra`` goes into every step row except ``code``, which goes into ``settings.json``."""
    d = root / "runs" / f"{name}_s{seed}"
    d.mkdir(parents=True)
    n = max(s for s, _ in evals)
    split = {k: [wall / 4, cpu / 4] for k in PHASES}
    if "code" in extra:
        (d / "settings.json").write_text(json.dumps({"arm": name, "code": extra.pop("code")}))
    steps = [
        {"step": s, "t": 0.0, "wall_s": wall, "cpu_s": cpu, "split": split, "update_tokens": tokens}
        for s in range(1, n + 1)
    ]
    steps = [{**r, **extra} for r in steps]
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    rows = [{"step": s, "eval_reward_mean": r, "eval_n": 4, "time_eval": 1.0} for s, r in evals]
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "done.json").write_text(json.dumps({"stopped": stop, "steps": n, "cpu_s": n * cpu}))


CONFIG = dict(
    steps=4, eval_every=2, prompts_per_step=2, num_generations=4, max_new_tokens=8,
    eval_max_new_tokens=8, eval_size=4, eval_batch_size=4, lr=1e-5, generate=8, keep=2,
    max_steps_factor=3.0, model="/x/tiny", seeds=1, first_seed=0, arms="trl_grpo,trl_d3s",
    machine="x86_64", cpus=2,
)  # fmt: skip


def _race(root: Path) -> None:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    # the reference: 4 steps of 10 CPU s -> budget 40; threshold = mean(0.3, 0.5) = 0.4
    _arm(root, REFERENCE, 0, [(0, 0.1), (2, 0.3), (4, 0.5)], 10.0, 20.0, 100.0, stop="steps")
    # 5 CPU s a step: evals at 10 and 20 CPU s (0.2, 0.6): crosses 0.4 at 15 CPU s, 60 wall s
    _arm(root, "trl_d3s", 0, [(0, 0.1), (2, 0.2), (4, 0.6), (8, 0.7)], 5.0, 40.0)
    # crosses 0.4 at 24 + 0.8 x 24 = 43.2 CPU s, past the budget: not reached within it
    _arm(root, "nd3s_grpo", 0, [(0, 0.1), (4, 0.2), (8, 0.45)], 6.0, 6.0)
    _arm(root, "nd3s_d3s", 0, [(0, 0.5), (2, 0.5)], 20.0, 20.0)  # reached at step 0
    runs = [(REFERENCE, 0.0, 10.0), ("trl_d3s", 10.0, 20.0), ("nd3s_grpo", 20.0, 30.0)]
    runs.append(("nd3s_d3s", 30.0, 40.0))
    rows = [
        {"arm": a, "seed": 0, "start": s, "end": e, "exit": 0, "cpu_s": 1.0} for a, s, e in runs
    ]
    (root / "arms.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_crossings_and_values_between_evals():
    pts = [{"cpu": 0.0, "wall": 0.0, "eval": 0.1}, {"cpu": 10.0, "wall": 40.0, "eval": 0.3}]
    pts.append({"cpu": 30.0, "wall": 50.0, "eval": 0.7})
    assert report.crossing(pts, 0.5, "cpu") == pytest.approx(20.0)
    assert report.crossing(pts, 0.5, "wall") == pytest.approx(45.0)
    assert report.crossing(pts, 0.05, "cpu") == 0.0
    assert report.crossing(pts, 0.8, "cpu") is None
    assert report.value_at(pts, 5.0) == pytest.approx(0.2)
    assert report.value_at(pts, 30.0) == pytest.approx(0.7)
    assert report.value_at(pts, 31.0) is None


def test_overlapping_arms_are_named():
    rows = [
        {"arm": "a", "seed": 0, "start": 0.0, "end": 10.0},
        {"arm": "b", "seed": 0, "start": 10.0, "end": 20.0},
        {"arm": "c", "seed": 1, "start": 15.0, "end": 30.0},
    ]
    assert report.overlaps(rows) == ["b s0 / c s1"]


def test_summary_budget_threshold_and_render(tmp_path):
    root = tmp_path / "race"
    _race(root)
    s = report.summarize(root)
    assert s["seeds"][0] == {"budget_cpu_s": 40.0, "threshold": 0.4, "threshold_steps": [2, 4]}
    assert s["overlaps"] == []
    a = s["arms"]
    ref, d3s = a[REFERENCE]["per_seed"][0], a["trl_d3s"]["per_seed"][0]
    assert ref["time_to_threshold_cpu"] == pytest.approx(30.0)  # 20 + (0.1 / 0.2) x 20
    assert ref["eval_at_budget"] == pytest.approx(0.5)
    assert d3s["time_to_threshold_cpu"] == pytest.approx(15.0)
    assert d3s["time_to_threshold_wall"] == pytest.approx(120.0)
    assert d3s["eval_at_budget"] == pytest.approx(0.7)  # its 8 steps spent 40 CPU s
    assert d3s["cpu_per_step"] == 5.0 and d3s["steps"] == 8
    grpo = a["nd3s_grpo"]
    assert grpo["per_seed"][0]["time_to_threshold_cpu"] is None and grpo["reached"] == 0
    assert grpo["per_seed"][0]["eval_at_budget"] == pytest.approx(0.2 + 16 / 24 * 0.25)
    assert grpo["time_to_threshold_cpu_censored"][0] == pytest.approx(40.0)  # the budget
    assert grpo["time_to_threshold_wall_censored"][0] == pytest.approx(40.0)  # wall at the budget
    assert a["nd3s_d3s"]["per_seed"][0]["time_to_threshold_cpu"] == 0.0
    assert a["nd3s_pods"]["runs"] == 0
    body = report.render(json.loads(json.dumps(s)))  # what the record holds
    assert body == report.render(s)
    assert "4 arm runs from 1970-01-01 00:00 to 1970-01-01 00:00 UTC, none overlapping" in body
    assert "seed 0: 40 CPU s, 0.400 (steps 2, 4)" in body
    assert (
        "| `trl_d3s` | 1 | 8.0 (budget) | 5.0 | 40.0 | - | 0.700 | 15 | 120 | 1 of 1 | 1 of 1 |"
        in body
    )
    # not reached: the censored time is the budget (and the wall seconds at it)
    assert (
        "| `nd3s_grpo` | 1 | 8.0 (budget) | 6.0 | 6.0 | - | 0.367 | 40 | 40 | 0 of 1 | 0 of 1 |"
        in body
    )
    assert "| `trl_grpo` | 2.5 | 2.5 | 2.5 | 2.5 | 25% | 100 | never (TRL) |" in body
    assert "| `nd3s_grpo` | 1.5 | 1.5 | 1.5 | 1.5 | 25% | 10 | 0 of 8 |" in body
    assert "PARTIAL" not in body and "WARNING" not in body
    assert "unrecorded: `trl_grpo` s0, `trl_d3s` s0, `nd3s_grpo` s0, `nd3s_d3s` s0." in body
    assert "the update is 25% of the CPU seconds" in body and "at most 1.33x cheaper" in body
    assert (
        "- `trl_d3s` vs `trl_grpo`, seed by seed: cheaper per step on 1 of 1; reaches the "
        "threshold sooner on 1 of 1; holds it to the budget on 1 of 1 (`trl_grpo`: 1); higher "
        "eval at the budget on 1 of 1." in body
    )
    assert "Where `trl_d3s` does not win" not in body
    assert (
        "- `nd3s_d3s` vs `nd3s_grpo`, seed by seed: cheaper per step on 0 of 1; reaches the "
        "threshold sooner on 1 of 1; holds it to the budget on 1 of 1 (`nd3s_grpo`: 0); higher "
        "eval at the budget on 1 of 1.\n"
        "  Where `nd3s_d3s` does not win: seed 0: 20.0 vs 6.0 CPU s/step." in body
    )
    assert "`nd3s_pods` vs" not in body  # no run, no verdict
    rows = read_rows(root / "arms.jsonl")
    rows[1]["start"] = 5.0  # trl_d3s started before the reference ended
    (root / "arms.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = report.render(report.summarize(root))
    assert "OVERLAPPING: trl_grpo s0 / trl_d3s s0" in over
    assert "failed and ran again" not in over
    failed = {**rows[2], "start": -20.0, "end": -10.0, "exit": 1}  # nd3s_grpo's first try
    rows = [failed, *rows[:1], {**rows[1], "start": 10.0}, *rows[2:]]
    (root / "arms.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = report.render(report.summarize(root))
    assert (
        "5 arm runs from 1969-12-31 23:59 to 1970-01-01 00:00 UTC, none overlapping (start and "
        "end of each in `arms.jsonl`); 1 failed and ran again from the start: `nd3s_grpo` seed 0."
        in again
    )
    doc = tmp_path / "doc.md"
    doc.write_text(f"# x\n\n{report.BEGIN}\nOLD-SECTION\n{report.END}\n\ntail\n")
    report.replace_section(doc, body)
    text = doc.read_text()
    assert "OLD-SECTION" not in text and body in text and text.endswith("\ntail\n")


def test_the_record_holds_every_run_and_renders_alone(tmp_path):
    """``report --record`` copied the summary, config and arm rows but no run's settings, steps
    or evals, so the record could not be rendered again; it copies them now (runs set aside
    too, which the report names), and the record renders as the race folder does."""
    root = tmp_path / "race"
    _race(root)
    aside = root / "runs" / "nd3s_d3s_s0.try1"
    aside.mkdir()
    (aside / "steps.jsonl").write_text('{"step": 1}\n')  # a cut try
    (root / "logs").mkdir()
    (root / "logs" / "trl_d3s_s0.log").write_text("its log\n")
    rec = tmp_path / "record"
    argv = ["report", "--out", str(root), "--record", str(rec)]
    assert vs_trl.report(vs_trl.parse_args(argv)) == 0
    assert (rec / "runs" / "trl_d3s_s0" / "eval.jsonl").read_text() == (
        root / "runs" / "trl_d3s_s0" / "eval.jsonl"
    ).read_text()
    assert (rec / "logs" / "trl_d3s_s0.log").read_text() == "its log\n"
    from_race = json.loads((root / "vs_trl.json").read_text())
    again = {**report.summarize(rec), "record": from_race["record"]}
    assert report.render(again) == report.render(from_race)
    body = report.render(again)
    assert "Runs set aside and not read: `nd3s_d3s_s0.try1` (cut or failed)." in body
    assert "4 arm runs (with those set aside below that the runner lived to record)" in body


def _three_seeds(root: Path) -> None:
    """Three seeds with the reference of ``_race`` (budget 40, threshold 0.4 each)."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**CONFIG, "seeds": 3}))
    for seed in range(3):
        _arm(root, REFERENCE, seed, [(0, 0.1), (2, 0.3), (4, 0.5)], 10.0, 20.0, stop="steps")


def test_time_to_threshold_is_the_censored_mean_when_some_seeds_do_not_reach_it(tmp_path):
    """1 of 3 seeds reaches the threshold: the time column is the mean over the 3 seeds with
    the budget for the 2 that did not (a lower bound), not the reaching seed's 15 CPU s."""
    root = tmp_path / "race"
    _three_seeds(root)
    _arm(root, "trl_d3s", 0, [(0, 0.1), (2, 0.2), (4, 0.6), (8, 0.7)], 5.0, 40.0)  # 15 CPU s
    for seed in (1, 2):
        _arm(root, "trl_d3s", seed, [(0, 0.1), (4, 0.2), (8, 0.3)], 5.0, 40.0)  # never
    a = report.summarize(root)["arms"]["trl_d3s"]
    assert (a["reached"], a["runs"]) == (1, 3)
    m, h = mean_ci([15.0, 40.0, 40.0])
    assert a["time_to_threshold_cpu_censored"] == (pytest.approx(m), pytest.approx(h))
    assert a["time_to_threshold_cpu"][0] == 15.0  # the reaching seed alone: kept, not shown
    wall, wh = mean_ci([120.0, 320.0, 320.0])  # its crossing; 8 steps of 40 wall s, twice
    assert a["time_to_threshold_wall_censored"] == (pytest.approx(wall), pytest.approx(wh))
    body = report.render(report.summarize(root))
    assert f"| {m:.0f} ± {h:.0f} | {wall:.0f} ± {wh:.0f} | 1 of 3 | 1 of 3 |" in body
    assert "| 15 |" not in body


def test_an_arm_the_cap_stopped_under_the_budget_is_flagged_not_failed(tmp_path):
    """6 steps of 5 CPU s (30 of a 40 s budget), stopped by the cap: it did not fail to reach
    the threshold within the budget, it stopped looking; its last eval stands in for the eval
    at the budget, marked, and the verdicts leave what it cannot decide open. A trainer arm
    whose cap step also spent the budget says ``cap`` in done.json: it is read as the budget."""
    root = tmp_path / "race"
    _race(root)
    shutil.rmtree(root / "runs" / "nd3s_d3s_s0")
    _arm(root, "nd3s_d3s", 0, [(0, 0.1), (2, 0.2), (6, 0.3)], 5.0, 5.0, stop="cap")
    _arm(root, "nd3s_d3s_floor", 0, [(0, 0.1), (2, 0.2)], 20.0, 20.0, stop="cap")  # 40 of 40
    s = report.summarize(root)
    capped = s["arms"]["nd3s_d3s"]["per_seed"][0]
    assert capped["capped"] and capped["eval_at_budget"] is None
    assert capped["time_to_threshold_cpu"] is None
    assert capped["time_to_threshold_cpu_censored"] == 30.0  # what it spent, not the budget
    assert not s["arms"]["nd3s_d3s_floor"]["per_seed"][0]["capped"]
    body = report.render(s)
    row = "| `nd3s_d3s` | 1 | 6.0 (cap†) | 5.0 | 5.0 | - | 0.300† | 30† | 30† | 0 of 1 "
    assert row + "(1 capped†) | 0 of 1 |" in body
    assert "| `nd3s_d3s_floor` | 1 | 2.0 (budget) |" in body
    assert (
        "† Stopped by the cap before spending the budget: `nd3s_d3s` seed 0 at 6 steps, 30 of "
        "40 CPU s; its eval at the budget is its eval at its last step" in body
    )
    assert (
        "- `nd3s_d3s` vs `nd3s_grpo`, seed by seed: cheaper per step on 1 of 1; reaches the "
        "threshold sooner on 0 of 1; holds it to the budget on 0 of 1 (`nd3s_grpo`: 0); higher "
        "eval at the budget on 0 of 1.\n"
        "  Left open†: seed 0: who reaches the threshold first (a run stopped by the cap); seed "
        "0: the eval at the budget (at the last steps: 0.300 vs 0.450†)." in body
    )
    assert "not reached within the budget" not in body.split("`nd3s_d3s` vs")[1]
    # one that reached it at 24 CPU s where the capped run looked for 30: a loss, said so
    (root / "runs" / "nd3s_grpo_s0" / "eval.jsonl").write_text(
        "".join(
            json.dumps({"step": st, "eval_reward_mean": r, "eval_n": 4, "time_eval": 1.0}) + "\n"
            for st, r in [(0, 0.1), (4, 0.4), (8, 0.45)]
        )
    )
    assert (
        "Where `nd3s_d3s` does not win: seed 0: threshold not reached in the 30 CPU s it ran "
        "before the cap†, `nd3s_grpo` at 24." in report.render(report.summarize(root))
    )


def test_shared_machine_code_versions_and_missing_runs_are_said(tmp_path):
    root = tmp_path / "race"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**CONFIG, "seeds": 2}))
    a, b = {"commit": "a" * 40, "dirty": False, "diff_sha256": None}, {"commit": "b" * 40}
    b.update(dirty=True, diff_sha256="c" * 64)
    evals = [(0, 0.1), (2, 0.3), (4, 0.5)]
    _arm(root, REFERENCE, 0, evals, 10.0, 20.0, stop="steps", load1=1.1, code=a)
    _arm(root, "trl_d3s", 0, evals, 10.0, 20.0, load1=1.3, code=b)
    _arm(root, REFERENCE, 1, evals, 10.0, 20.0, stop="steps", load1=1.0)  # an old record
    (root / "runs" / "trl_d3s_s1").mkdir()  # cut (no done.json)
    (root / "runs" / "trl_d3s_s0.try1").mkdir()  # a kept try: not read
    rows = [{"arm": "nd3s_grpo", "seed": 1, "start": 0.0, "end": 1.0, "exit": 1, "cpu_s": 1.0}]
    (root / "arms.jsonl").write_text(json.dumps(rows[0]) + "\n")
    s = report.summarize(root)
    assert s["arms"]["trl_d3s"]["runs"] == 1 and s["expected_runs"] == 4
    assert s["missing"] == [{"arm": "trl_d3s", "seed": 1, "state": "started, not finished"}]
    body = report.render(s)
    assert "| `trl_d3s` | 1 | 4.0 (budget) | 10.0 | 20.0 | 1.30 |" in body  # mean load1
    assert (
        "WARNING: run on a shared machine (mean load over its steps above 1 + 0.1 x 2 CPUs = 1.2;"
        " an arm alone loads about one core): `trl_d3s` seed 0 (1.30);" in body
    )
    assert "`trl_grpo` seed 0 (1.10)" not in body
    assert (
        "`aaaaaaaaaa`: `trl_grpo` s0; `bbbbbbbbbb` + uncommitted changes (diff cccccccc): "
        "`trl_d3s` s0; unrecorded: `trl_grpo` s1." in body
    )
    assert "WARNING: the runs ran 2 different versions of the code." in body
    assert "WARNING: some runs' code is unrecorded" in body
    assert body.startswith("Regenerated by") and (
        "\n\nPARTIAL: 1 of the 4 runs this race asks for have no record yet, so what follows "
        "covers only the finished ones: `trl_d3s` seed 1 (started, not finished).\n" in body
    )
    (root / "config.json").write_text(json.dumps({**CONFIG, "seeds": 2, "arms": "nd3s_grpo"}))
    missing = report.summarize(root)["missing"]
    assert missing == [
        {"arm": "nd3s_grpo", "seed": 0, "state": "not run yet"},
        {"arm": "nd3s_grpo", "seed": 1, "state": "failed, exit 1"},
    ]
    # report --doc refuses an incomplete race unless --partial, which says it is partial
    doc = tmp_path / "doc.md"
    doc.write_text(f"# x\n\n{report.BEGIN}\nOLD-SECTION\n{report.END}\n")
    argv = ["report", "--out", str(root), "--doc", str(doc)]
    assert vs_trl.main(argv) == 2 and "OLD-SECTION" in doc.read_text()
    assert vs_trl.main([*argv, "--partial"]) == 0
    text = doc.read_text()
    assert "OLD-SECTION" not in text and "PARTIAL: 2 of the 4 runs this race asks for" in text
    assert "`nd3s_grpo` seed 0 (not run yet), `nd3s_grpo` seed 1 (failed, exit 1)." in text
    assert "1 failed and did not finish since: `nd3s_grpo` seed 1." in text


def test_the_cap_is_raised_on_a_running_race_only_when_no_finished_run_stopped_at_it(
    tmp_path, monkeypatch
):
    """The race's config.json pins its settings; a higher --max-steps-factor is taken (and
    recorded) while every finished run spent its budget first; a lower one, or one with a
    finished run the cap stopped, is refused."""
    root = tmp_path / "race"
    _race(root)  # its runs stopped by the budget (the reference by its steps)
    launched = []

    def fake_launch(name, ns, seed, root, env, budget):
        launched.append((name, seed, ns.max_steps_factor))
        _arm(root, name, seed, [(0, 0.1), (4, 0.5)], 10.0, 10.0)
        return 0

    monkeypatch.setattr(vs_trl, "launch", fake_launch)
    monkeypatch.setattr(vs_trl, "_model", lambda ns: "/x/tiny")
    shared = ["--steps", "4", "--eval-every", "2", "--prompts-per-step", "2", "--generate", "8"]
    shared += ["--num-generations", "4", "--max-new-tokens", "8", "--eval-max-new-tokens", "8"]
    shared += ["--eval-size", "4", "--eval-batch-size", "4", "--keep", "2"]
    argv = ["run", "--out", str(root), *shared, "--seeds", "2", "--arms", "trl_grpo,trl_d3s"]
    with pytest.raises(SystemExit, match="below the race's 3; a cap is only ever raised"):
        vs_trl.main([*argv, "--max-steps-factor", "2"])
    assert vs_trl.main([*argv, "--max-steps-factor", "10"]) == 0
    assert launched == [(REFERENCE, 1, 10.0), ("trl_d3s", 1, 10.0)]
    config = json.loads((root / "config.json").read_text())
    assert config["max_steps_factor"] == 10.0
    (change,) = config["max_steps_factor_changes"]
    assert (change["from"], change["to"]) == (3.0, 10.0)
    assert change["finished"] == ["nd3s_d3s_s0", "nd3s_grpo_s0", "trl_d3s_s0", "trl_grpo_s0"]
    assert vs_trl.main(argv) == 0 and len(launched) == 2  # the default (10) is the race's now
    body = report.render(report.summarize(root))
    assert "was raised from 3 to 10 x at" in body and "after 4 finished runs" in body
    # a finished run the cap stopped under its budget: no raise
    config["max_steps_factor_changes"] = []
    (root / "config.json").write_text(json.dumps({**config, "max_steps_factor": 3.0}))
    shutil.rmtree(root / "runs" / "trl_d3s_s1")
    _arm(root, "trl_d3s", 1, [(0, 0.1), (2, 0.2)], 5.0, 5.0, stop="cap")  # 10 of 40 CPU s
    with pytest.raises(SystemExit, match=r"trl_d3s_s1 \(10 of 40 CPU s\) stopped at it"):
        vs_trl.main([*argv, "--max-steps-factor", "10"])
    assert vs_trl.main([*argv, "--max-steps-factor", "3"]) == 0  # the race's cap: goes on


def _fake_arm(script: str):
    """An ``arm_command`` stand-in: a Python process running ``script`` with the run folder."""

    def command(name, ns, seed, out, budget):
        return [sys.executable, "-c", script, str(out)]

    return command


_WRITES_SETTINGS = """
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
(out / "settings.json").write_text(json.dumps({"arm": "trl_d3s"}, indent=1))
(out / "steps.jsonl").write_text("")
print("partial output")
sys.exit(FAIL)
"""


def test_a_failed_or_cut_try_is_kept_and_the_code_is_recorded(tmp_path, monkeypatch):
    """A folder without done.json (a run cut, as the live race leaves one) and its log are
    moved to ``<arm>_s<seed>.try<k>`` instead of deleted, try after try; the code the arm ran
    goes into its settings.json and arms.jsonl."""
    root = tmp_path / "race"
    (root / "logs").mkdir(parents=True)
    (root / "runs" / "trl_d3s_s0").mkdir(parents=True)
    (root / "runs" / "trl_d3s_s0" / "steps.jsonl").write_text('{"step": 1}\n')  # cut
    (root / "logs" / "trl_d3s_s0.log").write_text("the cut run's log\n")
    code = {"commit": "f" * 40, "dirty": False, "diff_sha256": None, "untracked": 0}
    monkeypatch.setattr(vs_trl, "code_version", lambda: code)
    monkeypatch.setattr(vs_trl, "arm_command", _fake_arm(_WRITES_SETTINGS.replace("FAIL", "1")))
    assert vs_trl.launch("trl_d3s", None, 0, root, dict(os.environ), 40.0) == 1
    kept = root / "runs" / "trl_d3s_s0.try1"
    assert (kept / "steps.jsonl").read_text() == '{"step": 1}\n'
    assert (root / "logs" / "trl_d3s_s0.try1.log").read_text() == "the cut run's log\n"
    assert vs_trl.launch("trl_d3s", None, 0, root, dict(os.environ), 40.0) == 1  # failed again
    assert "partial output" in (root / "logs" / "trl_d3s_s0.try2.log").read_text()
    assert json.loads((root / "runs" / "trl_d3s_s0.try2" / "settings.json").read_text())["code"]
    monkeypatch.setattr(vs_trl, "arm_command", _fake_arm(_WRITES_SETTINGS.replace("FAIL", "0")))
    assert vs_trl.launch("trl_d3s", None, 0, root, dict(os.environ), 40.0) == 0
    settings = json.loads((root / "runs" / "trl_d3s_s0" / "settings.json").read_text())
    assert settings == {"arm": "trl_d3s", "code": code}
    runs = ["trl_d3s_s0", "trl_d3s_s0.try1", "trl_d3s_s0.try2", "trl_d3s_s0.try3"]
    assert sorted(p.name for p in (root / "runs").iterdir()) == runs  # the cut one, 2 failed
    assert "partial output" in (root / "logs" / "trl_d3s_s0.try3.log").read_text()
    assert [r["commit"] for r in read_rows(root / "arms.jsonl")] == ["f" * 40] * 3


def test_the_code_version_names_the_commit_and_uncommitted_changes(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    clean = vs_trl.code_version(tmp_path)
    assert clean == {"commit": head.stdout.strip(), "dirty": False, "diff_sha256": None,
                     "untracked": 0}  # fmt: skip
    (tmp_path / "a.py").write_text("x = 2\n")
    edited = vs_trl.code_version(tmp_path)
    assert edited["dirty"] and len(edited["diff_sha256"]) == 64
    (tmp_path / "b.py").write_text("")
    both = vs_trl.code_version(tmp_path)
    assert both["untracked"] == 1 and both["diff_sha256"] != edited["diff_sha256"]
    assert vs_trl.code_version(tmp_path / "nowhere") is None


def test_the_evidence_section_is_the_record():
    """docs/evidence.md's vs_trl section is what `vs_trl.py report --doc` renders from the
    committed record, or, with no record, says plainly that the race has not been run."""
    text = (REPO / "docs" / "evidence.md").read_text()
    section = text.split(report.BEGIN, 1)[1].split(report.END, 1)[0].strip()
    record = REPO / "benchmarks" / "results" / "vs_trl" / "vs_trl.json"
    if record.is_file():
        assert section == report.render(json.loads(record.read_text())).strip()
    else:
        assert section.startswith("Not run yet")


def test_a_later_call_adds_seeds_and_refuses_other_settings(tmp_path):
    path = tmp_path / "config.json"
    first = {**CONFIG, "seeds": 1, "first_seed": 0, "arms": "trl_grpo"}
    assert vs_trl.merge_race(path, first) == first  # a new folder: as given
    path.write_text(json.dumps(first))
    later = {**first, "seeds": 2, "first_seed": 1, "arms": "trl_grpo,trl_d3s"}
    merged = vs_trl.merge_race(path, later)
    assert (merged["first_seed"], merged["seeds"]) == (0, 3)  # seeds 0, 1, 2
    assert merged["arms"] == "trl_grpo,trl_d3s"
    with pytest.raises(SystemExit, match=r"other settings \(prompts_per_step\)"):
        vs_trl.merge_race(path, {**later, "prompts_per_step": 8})


def test_a_second_run_on_one_folder_is_refused(tmp_path):
    with vs_trl.RaceLock(tmp_path):
        with pytest.raises(SystemExit, match="another `run` is using this folder"):
            with vs_trl.RaceLock(tmp_path):
                pass
    with vs_trl.RaceLock(tmp_path):  # released
        pass


def test_a_lock_left_by_a_run_that_died_does_not_block_the_next(tmp_path):
    """A ``run`` killed (or its machine restarted) leaves ``run.lock`` behind; the next one
    used to refuse until the file was removed by hand. A lock held by a live process still
    refuses, naming its pid."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    (tmp_path / "run.lock").write_text(dead.stdout.strip())
    with vs_trl.RaceLock(tmp_path):
        assert (tmp_path / "run.lock").read_text() == str(os.getpid())
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path / "run.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=f"pid {holder.pid},"):
            with vs_trl.RaceLock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with vs_trl.RaceLock(tmp_path):  # the holder was killed: the kernel released its lock
        pass


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, str(os.getpid()).encode())
print("held", flush=True)
time.sleep(600)
"""


def test_a_stop_file_ends_the_race_between_arms(tmp_path, monkeypatch):
    """``STOP`` in the folder: ``run`` ends before its next arm, removes the file, and a later
    ``run`` goes on from there (the arm in progress is never cut)."""
    launched = []

    def fake_launch(name, ns, seed, root, env, budget):
        launched.append((name, seed, budget))
        d = root / "runs" / f"{name}_s{seed}"
        d.mkdir(parents=True)
        (d / "steps.jsonl").write_text(json.dumps({"step": 1, "cpu_s": 7.0}) + "\n")
        (d / "done.json").write_text("{}")
        if name == "trl_d3s":
            (root / "STOP").write_text("")  # asked while trl_d3s ran
        return 0

    monkeypatch.setattr(vs_trl, "launch", fake_launch)
    monkeypatch.setattr(vs_trl, "_model", lambda ns: "/x/tiny")
    argv = ["run", "--out", str(tmp_path), "--seeds", "2", "--arms", "trl_grpo,trl_d3s,nd3s_d3s"]
    assert vs_trl.main(argv) == 0
    assert launched == [(REFERENCE, 0, None), ("trl_d3s", 0, 7.0)]
    assert not (tmp_path / "STOP").exists()
    with vs_trl.RaceLock(tmp_path):  # released
        pass
    assert vs_trl.main(argv) == 0  # goes on, seed by seed, until seed 1's trl_d3s asks again
    assert launched[2:] == [("nd3s_d3s", 0, 7.0), (REFERENCE, 1, None), ("trl_d3s", 1, 7.0)]
    assert not (tmp_path / "STOP").exists()
    assert vs_trl.main(argv) == 0
    assert launched[5:] == [("nd3s_d3s", 1, 7.0)]
    assert vs_trl.main(argv) == 0 and len(launched) == 6  # every arm finished: nothing to run


def test_pods_keeps_fewer_than_it_generates():
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["run", "--out", "x", "--generate", "4", "--keep", "4"])


# the tiny race's batch and evals (prompts x rollouts, new tokens, eval problems)
_TINY = ["--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4"]
_TINY += ["--eval-max-new-tokens", "4", "--eval-size", "2", "--eval-batch-size", "2"]


def _tiny_model_and_env(tmp_path: Path):
    """(the tiny random model's folder, an environment whose Python finds this checkout)."""
    from nemo_d3s.backends.hf.config import TinyModelSpec
    from nemo_d3s.backends.hf.loading import ensure_tiny_folder

    folder = str(ensure_tiny_folder(TinyModelSpec(), 0, cache=tmp_path / "cache"))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return folder, env


@pytest.mark.slow
def test_a_trainer_arm_stopped_by_its_budget_between_evals_evaluates_its_last_step(tmp_path):
    """The budget spent after step 1 with evals every 2 steps: the arm evaluates step 1 before
    the trainer shuts down (a post-run eval met a closed reward pool in the first race)."""
    folder, env = _tiny_model_and_env(tmp_path)
    out = tmp_path / "arm"
    small = ["--steps", "2", "--eval-every", "2", *_TINY, "--max-steps-factor", "2"]
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "vs_trl.py"), "arm", "--name", "nd3s_grpo",
         "--model", folder, "--seed", "0", "--out", str(out), "--budget-cpu-s", "1e-9", *small],
        capture_output=True, text=True, timeout=WAIT_S, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    done = read_rows(out / "done.json")[0]
    assert (done["stopped"], done["steps"]) == ("budget", 1)
    assert [e["step"] for e in read_rows(out / "eval.jsonl")] == [0, 1]


@pytest.mark.slow
def test_a_trainer_arm_stopped_by_a_signal_is_not_finished(tmp_path):
    """SIGTERM ends the trainer at a checkpoint (its clean stop): the arm exits 75 and writes
    no done.json, so the next ``run`` runs it again (the first race's killed arm was recorded
    as finished with 0 steps)."""
    folder, env = _tiny_model_and_env(tmp_path)
    out = tmp_path / "arm"
    small = ["--steps", "500", "--eval-every", "500", *_TINY]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "vs_trl.py"), "arm", "--name", "nd3s_grpo",
         "--model", folder, "--seed", "0", "--out", str(out), *small],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT_S
        while not (out / "steps.jsonl").is_file() and proc.poll() is None:
            assert time.monotonic() < deadline, "the arm never finished a step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    assert not (out / "done.json").exists()
    assert 0 < len(read_rows(out / "steps.jsonl")) < 500


@pytest.mark.slow
@pytest.mark.trl
def test_the_race_runs_every_arm_alone_on_the_tiny_model(tmp_path):
    folder, env = _tiny_model_and_env(tmp_path)
    out = tmp_path / "race"
    small = ["--steps", "2", "--eval-every", "1", *_TINY, "--seeds", "1"]
    small += ["--generate", "4", "--keep", "2", "--max-steps-factor", "1.5"]
    # both trainers' GRPO and D3S and the PODS arm: every code path of the runner and the
    # report; the other arms differ only in settings (tested above)
    smoke = [REFERENCE, "trl_d3s", "nd3s_grpo", "nd3s_d3s", "nd3s_pods"]
    script = str(REPO / "benchmarks" / "vs_trl.py")
    r = subprocess.run(
        [sys.executable, script, "run", "--out", str(out), "--model", folder, *small,
         "--arms", ",".join(smoke)],
        capture_output=True, text=True, timeout=WAIT_S, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    with vs_trl.RaceLock(out):  # released
        pass
    rows = read_rows(out / "arms.jsonl")
    assert [row["arm"] for row in rows] == smoke  # the reference first, one run each
    assert all(row["exit"] == 0 and row["cpu_s"] > 0 for row in rows)
    assert report.overlaps(rows) == []
    budget = sum(s["cpu_s"] for s in read_rows(out / "runs" / f"{REFERENCE}_s0" / "steps.jsonl"))
    for name in smoke:
        d = out / "runs" / f"{name}_s0"
        done, steps = read_rows(d / "done.json")[0], read_rows(d / "steps.jsonl")
        assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)), name
        spent = sum(s["cpu_s"] for s in steps)
        assert done["cpu_s"] == pytest.approx(spent), name
        for s in steps:  # the phases sum to the step
            total = sum(s["split"][k][1] for k in PHASES)
            assert total == pytest.approx(s["cpu_s"], rel=1e-6, abs=1e-9), name
        if name == REFERENCE:
            assert done["stopped"] == "steps" and len(steps) == 2
            assert rows[0]["budget_cpu_s"] is None
        else:
            assert rows[smoke.index(name)]["budget_cpu_s"] == budget
            # the budget spent (the last step crosses it), or the cap of 1.5 x 2 steps first
            assert done["stopped"] in ("budget", "cap"), name
            assert (spent >= budget) if done["stopped"] == "budget" else len(steps) == 3
            assert spent - steps[-1]["cpu_s"] < budget, name
        evals = [e["step"] for e in read_rows(d / "eval.jsonl")]
        assert evals == list(range(len(steps) + 1)), name  # step 0, every step (eval_every 1)
        if ARMS[name].trainer == "trl":  # step s trains on prompts [s P, (s + 1) P): in order
            assert [s["prompt0"] for s in steps] == [2 * i for i in range(len(steps))]
        settings = json.loads((d / "settings.json").read_text())
        assert settings["arm"] == name and settings["schedule_steps"] == 2
    pods = json.loads((out / "runs" / "nd3s_pods_s0" / "settings.json").read_text())
    assert pods["num_generations"] == 4 and pods["d3s_config"]["schedule"]["n_init"] == 2
    r = subprocess.run(
        [sys.executable, script, "report", "--out", str(out)],
        capture_output=True, text=True, timeout=WAIT_S, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "vs_trl.json").read_text())
    assert all(summary["arms"][name]["runs"] == 1 for name in smoke)
    assert "none overlapping" in r.stdout
    assert (out / "vs_trl.png").is_file()
