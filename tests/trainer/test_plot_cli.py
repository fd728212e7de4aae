"""The plot command, and a Hydra multirun sweep writing one run directory per job."""

from __future__ import annotations

import json

import pytest

from nemo_d3s.trainer.metrics import read_jsonl
from nemo_d3s.trainer.plot import main as plot_main

from .conftest import cli


def _fake_run(d, scale):
    d.mkdir(parents=True)
    with (d / "metrics.jsonl").open("w") as f:
        for s in range(1, 6):
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "reward_mean": scale * s,
                        "update_tokens_total": 100.0 * s * scale,
                        "wall_time": 2.0 * s,
                    }
                )
                + "\n"
            )
    (d / "eval.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "eval_reward_mean": 0.1 * s}) for s in (0, 5)) + "\n"
    )


def test_plot_several_runs(tmp_path, capsys):
    _fake_run(tmp_path / "grpo", 1.0)
    _fake_run(tmp_path / "d3s", 0.5)
    out = tmp_path / "plots" / "reward.png"
    plot_main([str(tmp_path / "grpo"), str(tmp_path / "d3s"), "--out", str(out), "--smooth", "2"])
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_metrics_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        plot_main([str(tmp_path / "empty"), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2


@pytest.mark.slow  # whole programs (docs/ci.md)
def test_multirun_sweep_gives_each_job_its_own_directory(tmp_path):
    sweep = tmp_path / "sweep"
    r = cli(
        [
            "-m",
            "d3s=grpo,d3s",
            "experiment=smoke",
            "trainer.steps=1",
            "trainer.eval_at_start=false",
            "trainer.export_hf=false",
            "task.eval_size=2",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for job, preset in ((0, "grpo"), (1, "d3s")):
        rows = read_jsonl(sweep / str(job) / "metrics.jsonl")
        assert len(rows) == 1
        assert f"preset: {preset}" in (sweep / str(job) / "config.yaml").read_text()


@pytest.mark.slow  # whole programs (docs/ci.md)
def test_multirun_sweep_with_interpolated_output_dir(tmp_path):
    r = cli(
        [
            "-m",
            "d3s=grpo,pods",
            "experiment=smoke",
            # pods keeps 2 of G = 4 (its 1/4 keeps 1, refused); grpo ignores N
            "d3s.schedule.n_init=0.5",
            "d3s.schedule.n_final=0.5",
            "trainer.steps=1",
            "trainer.eval_at_start=false",
            "trainer.export_hf=false",
            "task.eval_size=2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            f"output_dir={tmp_path}/runs/${{d3s.preset}}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for preset in ("grpo", "pods"):
        assert len(read_jsonl(tmp_path / "runs" / preset / "metrics.jsonl")) == 1
