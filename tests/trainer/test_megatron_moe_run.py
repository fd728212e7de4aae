"""The whole trainer on a mixture of experts: ``torchrun --nproc_per_node=2`` of the Megatron
smoke run on a tiny random Qwen3-MoE at EP 2 (experts split over the two data-parallel
ranks, the all-to-all dispatcher on gloo) logs the run of the HF backend in one process with
the same seed (rewards, selections exactly; losses and grad norms to float tolerance),
trains, and writes checkpoints with one expert file per EP rank that convert to the
weights the run exported, bit for bit."""

from __future__ import annotations

import os
import sys

import pytest

from nemo_d3s.trainer.metrics import read_jsonl

from .conftest import REPO, run_inprocess
from .test_distributed import _assert_same_run
from .test_megatron_run import RUN, _finish, _torchrun

sys.path.insert(0, str(REPO / "tests" / "backends" / "megatron"))
sys.path.insert(0, str(REPO / "tests" / "convert"))
from _models import assert_same_tensors  # noqa: E402
from _tiny_hf import make_tiny_hf  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("qwen3_moe", []),
        ("qwen3_moe", ["+model.params.context_parallel_size=2"]),
        ("qwen3_moe", ["+model.params.distributed_optimizer=true"]),
        ("qwen2_moe", []),
    ],
    ids=["dp2ep2", "cp2ep2", "dp2ep2_distributed_optimizer", "dp2ep2_qwen2_moe"],
)
def test_megatron_smoke_at_ep2_trains_checkpoints_and_matches_the_hf_backend(tmp_path, arch, extra):
    """(``cp2ep2``: the two ranks are one model copy at context parallelism 2, each CP rank's
    engine samples half the prompts, the experts split over the CP ranks;
    ``dp2ep2_distributed_optimizer``: Megatron's distributed optimizer, the expert state in
    the expert files; ``dp2ep2_qwen2_moe``: a shared expert beside the routed ones)"""
    from nemo_d3s.convert import megatron_to_hf

    folder = str(make_tiny_hf(tmp_path / arch, arch, layers=2))
    hf_out = tmp_path / "hf"
    run_inprocess(hf_out, [*RUN, f"model.name={folder}"])
    hf_rows = read_jsonl(hf_out / "metrics.jsonl")
    assert any(r["optimizer_steps"] > 0 for r in hf_rows), "no step trained: vacuous"
    out = tmp_path / "megatron"
    _finish(
        _torchrun(
            2,
            [
                *RUN,
                f"model.name={folder}",
                "model.backend=megatron",
                "+model.params.expert_model_parallel_size=2",
                *extra,
                f"output_dir={out}",
            ],
        )
    )
    _assert_same_run(hf_rows, read_jsonl(out / "metrics.jsonl"), f"ep2 {extra}")
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert sorted(os.listdir(ckpt / "megatron")) == [
        "ep00_etp00_pp00.safetensors",
        "ep01_etp00_pp00.safetensors",
        "layout.json",
        "tp00_pp00.safetensors",
    ]
    back = megatron_to_hf(ckpt, tmp_path / "back", progress=False)
    assert_same_tensors(out / "hf_export", back)


def test_megatron_router_replay_at_ep2_logs_the_run_of_the_hf_backend(tmp_path):
    """``algorithm.router_replay=rollout`` one step stale (``rollout.max_staleness=1``: the
    engine's routing differs from the trainer's): the two-rank Megatron run at EP 2 replays the
    seeded sampler's routing as the HF backend does in one process, so both log the same run
    (the routing mismatch, recorded by megatron-core's routers, included)."""
    folder = str(make_tiny_hf(tmp_path / "q3", "qwen3_moe", layers=2))
    both = [*RUN, f"model.name={folder}", "algorithm.router_replay=rollout"]
    both += ["rollout.max_staleness=1", "trainer.steps=4", "trainer.save_every=0"]
    hf_out = tmp_path / "hf"
    run_inprocess(hf_out, both)
    hf_rows = read_jsonl(hf_out / "metrics.jsonl")
    assert any(r.get("rollout_routing_mismatch", 0.0) > 0 for r in hf_rows), "vacuous"
    out = tmp_path / "megatron"
    _finish(
        _torchrun(
            2,
            [
                *both,
                "model.backend=megatron",
                "+model.params.expert_model_parallel_size=2",
                f"output_dir={out}",
            ],
        )
    )
    _assert_same_run(hf_rows, read_jsonl(out / "metrics.jsonl"), "ep2 router replay")
