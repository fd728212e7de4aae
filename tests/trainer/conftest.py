"""Helpers for the trainer tests: compose the Hydra config in-process, run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]

# PODS on the smoke run's G = 4: its preset's N = 1/4 would keep one rollout a prompt, whose
# re-normalised advantage is 0, which the config refuses; 1/2 keeps 2.
PODS_SMOKE = ["d3s=pods", "d3s.schedule.n_init=0.5", "d3s.schedule.n_final=0.5"]

# Fast settings on top of experiment=smoke: no eval at start, a short eval at the end.
FAST = [
    "trainer.steps=2",
    "trainer.eval_at_start=false",
    "trainer.eval_every=0",
    "trainer.save_every=1000",  # one checkpoint, at the end (save_every=0 writes none)
    "trainer.export_hf=false",
    "task.eval_size=4",
]


def compose(overrides: Sequence[str]):
    """The config `python -m nemo_d3s.train <overrides>` would run (no Hydra run dir)."""
    from nemo_d3s.train import compose_config

    return compose_config(overrides)


def run_inprocess(out_dir: Path, overrides: Sequence[str] = ()):
    """Run training in this process on the smoke experiment; returns (state, metric rows)."""
    from nemo_d3s.trainer.loop import train
    from nemo_d3s.trainer.metrics import read_jsonl

    cfg = compose(["experiment=smoke", f"output_dir={out_dir}", *overrides])
    state = train(cfg)
    return state, read_jsonl(out_dir / "metrics.jsonl")


def cli_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cli(args: Sequence[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        **kw,
    )


def without_timing(rows: List[dict]) -> List[dict]:
    from nemo_d3s.trainer.metrics import is_timing_key

    return [{k: v for k, v in r.items() if not is_timing_key(k)} for r in rows]


@pytest.fixture(autouse=True)
def _quiet_threads():
    # Two cores: keep each test's torch to one thread so parallel subprocesses don't thrash.
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
