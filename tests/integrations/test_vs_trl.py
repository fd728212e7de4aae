"""benchmarks/vs_trl.py: the report on hand-made race folders (no TRL needed: budgets,
thresholds, crossings between evals, the budget cut-off, overlap detection, the verdicts), the
docs/evidence.md section as the record renders it, and a smoke of the whole race on the tiny
model (marker ``trl``: needs trl; CI's TRL leg), which checks what a run records, never how
long it took."""

from __future__ import annotations

import json
import os
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
from vs_trl_arms import ARMS, PHASES, REFERENCE, read_rows  # noqa: E402
from _limits import WAIT_S  # noqa: E402


def _arm(
    root: Path, name: str, seed: int, evals, cpu: float, wall: float, tokens=10.0, stop="budget"
):
    """An arm's records: len(steps) = the last eval's step, each step ``cpu`` / ``wall`` s."""
    d = root / "runs" / f"{name}_s{seed}"
    d.mkdir(parents=True)
    n = max(s for s, _ in evals)
    split = {k: [wall / 4, cpu / 4] for k in PHASES}
    steps = [
        {"step": s, "t": 0.0, "wall_s": wall, "cpu_s": cpu, "split": split, "update_tokens": tokens}
        for s in range(1, n + 1)
    ]
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
    assert a["nd3s_d3s"]["per_seed"][0]["time_to_threshold_cpu"] == 0.0
    assert a["nd3s_pods"]["runs"] == 0
    body = report.render(json.loads(json.dumps(s)))  # what the record holds
    assert body == report.render(s)
    assert "4 arm runs from 1970-01-01 00:00 to 1970-01-01 00:00 UTC, none overlapping" in body
    assert "seed 0: 40 CPU s, 0.400 (steps 2, 4)" in body
    assert "| `trl_d3s` | 1 | 8.0 (budget) | 5.0 | 40.0 | 10 | 0.700 | 15 | 120 | 1 of 1 |" in body
    assert "| `nd3s_grpo` | 1 | 8.0 (budget) | 6.0 | 6.0 | 10 | 0.367 | - | - | 0 of 1 |" in body
    assert "| `trl_grpo` | 2.5 | 2.5 | 2.5 | 2.5 | 25% |" in body
    assert "the update is 25% of the CPU seconds" in body and "at most 1.33x cheaper" in body
    assert (
        "- `trl_d3s` vs `trl_grpo`, seed by seed: cheaper per step on 1 of 1; reaches the "
        "threshold sooner on 1 of 1; higher eval at the budget on 1 of 1." in body
    )
    assert "Where `trl_d3s` does not win" not in body
    assert (
        "- `nd3s_d3s` vs `nd3s_grpo`, seed by seed: cheaper per step on 0 of 1; reaches the "
        "threshold sooner on 1 of 1; higher eval at the budget on 1 of 1.\n"
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
