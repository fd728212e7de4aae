"""benchmarks/vs_trl.py: its summary on hand-made run folders (no TRL needed), the
docs/evidence.md section as the record renders it, and a 2-step smoke of the whole race on
the tiny model (marker ``trl``: needs trl; deselected in the main run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import vs_trl  # noqa: E402
from _limits import WAIT_S  # noqa: E402


def _arm(root: Path, name: str, seed: int, evals, step_time: float, tokens: float, finished=True):
    d = root / "runs" / f"{name}_s{seed}"
    d.mkdir(parents=True)
    steps = [e[0] for e in evals if e[0] > 0]
    metrics = [
        {"step": s, "time_step": step_time, "wall_time": s * step_time, "update_tokens": tokens}
        for s in range(1, max(steps) + 1)
    ]
    for m in metrics:
        m["update_tokens_total"] = m["step"] * tokens
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    rows = [{"step": s, "eval_reward_mean": r, "time_eval": 0.0} for s, r in evals]
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (d / ("done.json" if name.startswith("trl") else "summary.json")).write_text("{}")


def _race(root: Path) -> None:
    config = dict(
        steps=4, eval_every=2, prompts_per_step=2, num_generations=4, max_new_tokens=8,
        eval_size=4, seeds=2, model="/x/tiny", cpus=2,
    )  # fmt: skip
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    for seed, ref in ((0, 0.5), (1, 0.25)):
        # threshold = trl_grpo's eval at step min(20, 4) = 4
        _arm(root, "trl_grpo", seed, [(0, 0.0), (2, 0.1), (4, ref)], 10.0, 100)
        # reaches it at step 2 -> 2 x 4 s of training
        _arm(root, "trl_d3s", seed, [(0, 0.0), (2, ref), (4, ref)], 4.0, 20)
        _arm(root, "nd3s_grpo", seed, [(0, 0.0), (2, 0.0), (4, 0.0)], 8.0, 90)  # never
    _arm(root, "nd3s_d3s", 0, [(0, 0.0), (2, 0.9)], 3.0, 10, finished=False)  # cut short


def test_summary_time_to_threshold_and_render(tmp_path):
    root = tmp_path / "race"
    _race(root)
    s = vs_trl.summarize(root)
    assert s["threshold_step"] == 4
    a = s["arms"]
    assert a["trl_grpo"]["time_to_threshold"][0] == pytest.approx(40.0)  # step 4 x 10 s
    assert a["trl_d3s"]["time_to_threshold"][0] == pytest.approx(8.0)
    assert a["trl_d3s"]["s_per_step"][0] == pytest.approx(4.0)
    assert a["trl_d3s"]["update_tokens_per_step"][0] == pytest.approx(20.0)
    assert a["nd3s_grpo"]["reached"] == 0 and a["nd3s_grpo"]["runs"] == 2
    assert a["nd3s_d3s"]["runs"] == 0  # an unfinished run is not counted
    body = vs_trl.render(s)
    assert "| `trl_d3s` | 2 | 4.0 ± 0.0 | 20 ± 0 | 0.375 ± 1.588 | 8.0 ± 0.0 | 2 of 2 |" in body
    assert "| `nd3s_d3s` | 0 | not run |" in body
    assert "| `nd3s_grpo` | 2 | 8.0 ± 0.0 | 90 ± 0 | 0.000 ± 0.000 | - | 0 of 2 |" in body
    assert (
        "`trl_d3s` vs `trl_grpo`, seed by seed: faster per step on 2 of 2 seeds; reaches the "
        "threshold sooner on 2 of 2." in body
    )
    assert "Where `trl_d3s` does not win" not in body
    # nd3s_d3s has no finished run: no verdict; and a seed where D3S loses is named
    assert "`nd3s_d3s` vs" not in body
    slow = [{"seed": 0, "s_per_step": 5.0, "time_to_threshold": None}]
    ref = [{"seed": 0, "s_per_step": 4.0, "time_to_threshold": 40.0}]
    assert vs_trl._verdict("x", "y", slow, ref) == [
        "- `x` vs `y`, seed by seed: faster per step on 0 of 1 seeds; reaches the threshold "
        "sooner on 0 of 1.",
        "- Where `x` does not win here: seed 0: 5.0 vs 4.0 s/step, never reaches the threshold.",
    ]
    assert "Machine load" not in body  # no samples, no claim
    rows = [{"t": 0.0, "load1": 2.0}, {"t": 30.0, "load1": 5.0}, {"t": 60.0, "load1": 2.0}]
    (root / "load.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = vs_trl.summarize(root)
    assert loaded["load"] == {"samples": 3, "mean": 3.0, "max": 5.0}
    assert "3 samples 30 s apart): mean 3.0, max 5.0, on 2 CPUs." in vs_trl.render(loaded)
    doc = tmp_path / "doc.md"
    doc.write_text(f"# x\n\n{vs_trl.BEGIN}\nOLD-SECTION\n{vs_trl.END}\n\ntail\n")
    vs_trl.replace_section(doc, body)
    text = doc.read_text()
    assert "OLD-SECTION" not in text and body in text and text.endswith("\ntail\n")


def test_the_evidence_section_is_the_record():
    """docs/evidence.md's vs_trl section is what `vs_trl.py report --doc` renders from the
    committed record, or, with no record, says plainly that the race has not been run."""
    text = (REPO / "docs" / "evidence.md").read_text()
    section = text.split(vs_trl.BEGIN, 1)[1].split(vs_trl.END, 1)[0].strip()
    record = REPO / "benchmarks" / "results" / "vs_trl" / "vs_trl.json"
    if record.is_file():
        assert section == vs_trl.render(json.loads(record.read_text())).strip()
    else:
        assert section.startswith("Not run yet")


@pytest.mark.trl
def test_the_race_runs_at_two_steps_on_the_tiny_model(tmp_path):
    from nemo_d3s.backends.hf.config import TinyModelSpec
    from nemo_d3s.backends.hf.loading import ensure_tiny_folder

    folder = str(ensure_tiny_folder(TinyModelSpec(), 0, cache=tmp_path / "cache"))
    out = tmp_path / "race"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    small = ["--steps", "2", "--eval-every", "1", "--prompts-per-step", "2"]
    small += ["--num-generations", "2", "--max-new-tokens", "4", "--eval-max-new-tokens", "4"]
    small += ["--eval-size", "2", "--eval-batch-size", "2", "--seeds", "1"]
    script = str(REPO / "benchmarks" / "vs_trl.py")
    r = subprocess.run(
        [sys.executable, script, "run", "--out", str(out), "--model", folder, *small],
        capture_output=True, text=True, timeout=WAIT_S, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [sys.executable, script, "report", "--out", str(out)],
        capture_output=True, text=True, timeout=WAIT_S, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "vs_trl.json").read_text())
    assert summary["threshold_step"] == 2
    for name in vs_trl.ARMS:
        arm = summary["arms"][name]
        assert arm["runs"] == 1, name
        assert [p["step"] for p in arm["per_seed"][0]["curve"]] == [0, 1, 2], name
        assert arm["s_per_step"][0] > 0 and arm["update_tokens_per_step"][0] >= 0, name
    # (a random model scores 0 on arithmetic: the trainer skips such steps, 0 update tokens;
    # TRL updates on them.) D3S's updates in TRL carry half of GRPO's rollouts here
    # (N = G/8 -> G/2 of G = 2 is 1 of 2), so fewer tokens.
    a, b = summary["arms"]["trl_d3s"], summary["arms"]["trl_grpo"]
    assert 0 < a["update_tokens_per_step"][0] < b["update_tokens_per_step"][0]
    assert (out / "vs_trl.png").is_file()


def test_a_later_call_adds_seeds_to_the_race_and_refuses_other_settings(tmp_path):
    path = tmp_path / "config.json"
    first = {"steps": 20, "prompts_per_step": 4, "seeds": 1, "first_seed": 0, "arms": "trl_grpo"}
    assert vs_trl._merge_race(path, first) == first  # a new folder: as given
    path.write_text(json.dumps(first))
    later = {**first, "seeds": 2, "first_seed": 1, "arms": "trl_grpo,trl_d3s"}
    merged = vs_trl._merge_race(path, later)
    assert (merged["first_seed"], merged["seeds"]) == (0, 3)  # seeds 0, 1, 2
    assert merged["arms"] == "trl_grpo,trl_d3s"  # what was run, not every arm there is
    with pytest.raises(SystemExit, match=r"other settings \(prompts_per_step\)"):
        vs_trl._merge_race(path, {**later, "prompts_per_step": 8})
