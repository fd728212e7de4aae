"""``SELFCHECK=1`` in the sbatch scripts (slurm/selfcheck_step.sh): the self-check runs under
torchrun on the job's ranks before training; a failed self-check stops the job with exit 2
before any training step. Run with test_examples.py's stand-in srun/scontrol on CPU ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_examples import REPO, SLURM, _SMOKE, _fake_slurm, _tiny_megatron  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = pytest.mark.distributed


def _run(tmp_path, script, overrides, **env_extra):
    env = _fake_slurm(tmp_path, "5151", SELFCHECK="1", **env_extra)
    return subprocess.run(
        ["bash", str(SLURM / script), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


@pytest.mark.parametrize(
    "script", ["train_dp.sbatch", pytest.param("train_megatron.sbatch", marks=pytest.mark.slow)]
)  # + its dry run
def test_a_failed_selfcheck_stops_the_job_before_training(tmp_path, script):
    overrides = _tiny_megatron(tmp_path)[1] if script == "train_megatron.sbatch" else _SMOKE
    r = _run(tmp_path, script, overrides, SELFCHECK_ARGS=f"--model {tmp_path / 'no_such_model'}")
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert "error: the self-check failed" in r.stderr and "training was not started" in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_selfcheck_then_training(tmp_path):
    overrides = [*_SMOKE, "trainer.steps=1"]
    r = _run(tmp_path, "train_dp.sbatch", overrides, SELFCHECK_ARGS="--only env,collectives")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    doc = json.loads((tmp_path / "run" / "selfcheck" / "restart0" / "selfcheck.json").read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["context"]["mode"] == "torchrun" and doc["context"]["world"] == 2
    assert (
        checks["collectives.gloo"]["status"] == "passed"
        and checks["collectives.gloo"]["measured"]["ranks"] == 2
    )
    assert checks["collectives.nccl"]["status"] == "not run"
    assert "1 passed" in r.stdout or "2 passed" in r.stdout
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rows] == [1]
