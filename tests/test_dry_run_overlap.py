"""The dry run's step model (dry_run/overlap.py) and the non-colocated layout: engines on
``rollout.generation_gpus`` GPUs apart from the training GPUs, the step's seconds and
GPU-seconds synchronous and overlapped (k = 1), worked by hand; experiment=llama3_70b_async
planned; the trainer refuses to start what only the dry run plans."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from nemo_d3s.backends.vllm.memory import HBM_BYTES_PER_S
from nemo_d3s.config import ConfigError
from nemo_d3s.dry_run import JobShape, plan, render
from nemo_d3s.dry_run.overlap import PEAK_FLOPS, kept_sample_share, step_model

GB = 1e9
REPO = Path(__file__).resolve().parents[1]


def _compose(overrides):
    from nemo_d3s.train import compose_config

    return compose_config(overrides)


def test_step_model_by_hand():
    """1024 rollouts over 4 engines (TP 8 on 32 GPUs), 100 full sequences of KV each: 3 waves
    of 2048 decode steps at 1 ms = 6.144 s; training 10 N FLOPs per token (scoring 2, update
    with recompute 8) x N = 989e9 x 1024 rollouts x 1000 tokens over 64 GPUs at 989 TFLOP/s =
    160 s; a step is their sum (synchronous) or the longer (k = 1), on 96 GPUs."""
    cfg = _compose(["experiment=llama3_70b_async", "d3s=grpo", "output_dir=x"])
    v = {"full_sequences": 100, "weights_bytes": HBM_BYTES_PER_S / 1000, "tensor_parallel_size": 8}
    m = step_model(cfg, world=64, dp=4, v=v, params=989e9, seq_len=1000, recompute=True)
    sync, k1 = m["layouts"]
    assert m["kept_sample_share"] == 1.0
    assert math.isclose(sync["generation_s"], 6.144) and math.isclose(sync["training_s"], 160.0)
    assert math.isclose(sync["step_s"], 166.144) and math.isclose(k1["step_s"], 160.0)
    assert sync["gpus"] == k1["gpus"] == 96
    assert math.isclose(k1["gpu_seconds"], 96 * 160.0) and k1["gpu_seconds"] < sync["gpu_seconds"]
    assert PEAK_FLOPS == 989e12
    coloc = _compose(["experiment=llama3_70b", "d3s=grpo", "output_dir=x"])
    (one,) = step_model(coloc, world=64, dp=4, v=v, params=989e9, seq_len=1000, recompute=False)[
        "layouts"
    ]  # 4 engines on the training GPUs, training 8 N per token without recompute
    assert one["gpus"] == 64 and math.isclose(one["step_s"], 6.144 + 128.0)


@pytest.mark.parametrize(
    "d3s,want",
    [
        (["d3s=grpo"], 1.0),
        (["d3s=pods"], 0.25),
        (["d3s=d3s"], (0.125 + 0.5) / 2),  # linear N 1/8 -> 1/2 of G: its mean
        (["d3s=pods", "d3s.schedule.n_init=2", "d3s.schedule.n_final=2"], 2 / 16),
    ],
)
def test_kept_sample_share_follows_the_schedule(d3s, want):
    cfg = _compose(["experiment=llama3_70b", "output_dir=x", *d3s])
    assert math.isclose(kept_sample_share(cfg), want)


def test_the_async_70b_recipe_plans_engines_apart_and_the_overlapped_step():
    report = plan(_compose(["experiment=llama3_70b_async", "output_dir=x"]), JobShape(8, 8, "t"))
    print(render(report))
    assert report["fits"], report["problems"]
    v = report["vllm"]
    assert v["engines"] == 4 and v["gpus_with_engine"] == 32 and v["separate_gpus"] == 32
    assert all("vllm" not in x["terms_bytes"] for x in report["positions"])  # none on training
    assert v["full_sequences"] >= v["rows_per_engine_step"] == 256  # one wave
    sync, k1 = report["step_model"]["layouts"]
    gen = 2048 * 2 * 70_553_706_496 / 8 / HBM_BYTES_PER_S  # decode floor, one wave
    train = 10 * 70_553_706_496 * 1024 * (0.125 + 0.5) / 2 * 3072 / (64 * PEAK_FLOPS)
    assert math.isclose(sync["generation_s"], gen) and math.isclose(sync["training_s"], train)
    assert math.isclose(sync["step_s"], gen + train) and math.isclose(k1["step_s"], max(gen, train))
    assert k1["gpu_seconds"] < sync["gpu_seconds"] and sync["gpus"] == 96
    assert "engines on 32 GPUs apart, k = 1 (overlapped)" in render(report)
    # the layout line counts the engines apart, not the colocated recipe's 2 per model copy
    layout = render(report).splitlines()[1]
    assert layout.endswith("rollout=vllm (vLLM TP 8), engines on 32 GPUs apart"), layout
    recipe = (REPO / "conf" / "experiment" / "llama3_70b_async.yaml").read_text()
    recipe = " ".join(recipe.replace("#", "").split())
    m = re.search(
        r"carries an engine: ([\d.]+) GB peak.*?([\d.]+) GB awake.*?weights ([\d.]+) GB",
        recipe,
    )
    assert m, "the recipe's figures are gone"
    assert [float(x) for x in m.groups()] == [
        round(report["worst"]["peak_bytes"] / GB, 1),
        round(v["awake_bytes"] / GB, 1),
        round(v["weights_bytes"] / GB, 1),
    ]


def test_an_engine_gpu_apart_that_does_not_hold_the_awake_engine_is_a_problem():
    """0.95 x 85.52 GB (an 80 GB H100's CUDA total) is over 80 GB before the engine's context."""
    cfg = _compose(["experiment=llama3_70b_async", "rollout.gpu_memory_utilization=0.95"])
    report = plan(cfg, JobShape(8, 8, "t"))
    assert report["vllm"]["awake_bytes"] > 80 * GB and not report["fits"]
    assert any("engine GPU apart needs" in p for p in report["problems"]), report["problems"]


def test_overlapped_on_the_training_gpus_the_engine_stays_awake_and_70b_does_not_fit():
    cfg = _compose(["experiment=llama3_70b", "rollout.max_staleness=1", "output_dir=x"])
    report = plan(cfg, JobShape(8, 8, "t"))
    first = next(x for x in report["positions"] if (x["tp_rank"], x["pp_rank"]) == (0, 0))
    assert first["terms_bytes"]["vllm_asleep"] == first["terms_bytes"]["vllm"]  # no sleep
    assert not report["fits"]
    sync = plan(_compose(["experiment=llama3_70b", "output_dir=x"]), JobShape(8, 8, "t"))
    assert sync["fits"]


def test_generation_gpus_are_checked_and_the_trainer_refuses_them():
    from nemo_d3s.config import validate
    from nemo_d3s.trainer.build import check_runtime

    with pytest.raises(ConfigError, match="generation_gpus"):
        validate(_compose(["rollout.generation_gpus=8", "output_dir=x"]))  # rollout=hf
    with pytest.raises(ConfigError, match="generation_gpus"):
        validate(_compose(["experiment=llama3_70b_async", "rollout.generation_gpus=12"]))
    with pytest.raises(ConfigError, match="planned by the dry run"):
        check_runtime(_compose(["experiment=llama3_70b_async", "output_dir=x"]))
