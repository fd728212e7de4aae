"""The whole trainer on the Megatron backend: ``torchrun --nproc_per_node=4`` at TP2 x PP2
and ``--nproc_per_node=2`` at TP1 x DP2 (plain AdamW and Megatron's distributed optimizer)
on a tiny Llama folder log the same run as the HF
backend in one process with the same seed (rewards, kept counts, selections exactly;
losses, grad norms and exported weights to float tolerance); a run killed with SIGKILL and
resumed ends with the metrics of an uninterrupted one.

Tolerances: the two backends compute the same function with different kernels (Megatron's
fused QKV and vocab-parallel softmax vs transformers' eager ops), ~1e-6 relative apart;
Adam's first steps amplify that in tiny gradient entries (lr g / (|g| + eps)), hence the
weight tolerance of ``test_distributed``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from nemo_d3s.trainer.metrics import read_jsonl

from .conftest import REPO, cli_env, run_inprocess
from .test_distributed import _assert_same_run, _assert_same_weights

sys.path.insert(0, str(REPO / "tests" / "backends" / "megatron"))
from _tiny_hf import make_tiny_hf  # noqa: E402
from _limits import WAIT_S  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = [
    "experiment=smoke",
    "trainer.steps=3",
    "trainer.eval_every=0",
    "trainer.eval_at_start=false",
    "trainer.save_every=1",
    "trainer.max_new_tokens=12",
    "task.eval_size=4",
    "~model.params.tiny",
]


def _megatron(tp, pp):
    return [
        "model.backend=megatron",
        f"+model.params.tensor_model_parallel_size={tp}",
        f"+model.params.pipeline_model_parallel_size={pp}",
    ]


def _torchrun(nproc, overrides, env=None, **kw):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "nemo_d3s.train",
            *overrides,
        ],
        cwd=REPO,
        env={**cli_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _finish(proc, timeout=WAIT_S):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("tiny") / "llama", "llama", tied=False))


@pytest.fixture(scope="module")
def hf_run(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "run"
    run_inprocess(out, [*RUN, f"model.name={folder}"])
    rows = read_jsonl(out / "metrics.jsonl")
    assert any(r["optimizer_steps"] > 0 for r in rows), (
        "no step trained: the comparison would be vacuous"
    )
    return out


# the long-sequence options together: sequence parallelism, two virtual pipeline chunks per
# stage (interleaved 1F1B) and length-aware micro-batches; the HF run uses fixed micro-batches
LONG = [
    "+model.params.sequence_parallel=true",
    "+model.params.virtual_pipeline_model_parallel_size=2",
    "trainer.micro_batch_tokens=48",
]


@pytest.mark.parametrize(
    "tp,pp,nproc,dopt,options",
    [
        (2, 2, 4, False, []),
        (1, 1, 2, False, []),
        (1, 1, 2, True, []),
        (2, 2, 4, False, LONG),
        (2, 2, 4, False, [*LONG, "trainer.pack_sequences=true"]),
        (2, 2, 4, False, ["+model.params.rollout_engines_per_copy=2"]),
    ],
    ids=[
        "tp2pp2",
        "tp1dp2",
        "tp1dp2_distributed_optimizer",
        "tp2pp2_sp_vpp2_tokens",
        "tp2pp2_sp_vpp2_packed",
        "tp2pp2_two_engines",
    ],
)
def test_megatron_torchrun_matches_the_hf_backend(
    folder, hf_run, tmp_path, tp, pp, nproc, dopt, options
):
    """(the CPU default is the plain AdamW path; ``distributed_optimizer=true`` runs Megatron's
    DDP + distributed optimizer, the CUDA default, on gloo; ``two_engines``: an engine on each
    half of the TP 2 x PP 2 copy, ranks 0 and 2, each generating half the prompts and
    evaluation problems, each refitted after every step)"""
    out = tmp_path / "megatron"
    extra = ["+model.params.distributed_optimizer=true"] if dopt else []
    log = _finish(
        _torchrun(
            nproc,
            [
                *RUN,
                f"model.name={folder}",
                *_megatron(tp, pp),
                *extra,
                *options,
                f"output_dir={out}",
            ],
        )
    )
    assert ("distributed optimizer (fp32 main weights" in log) == dopt, log[-3000:]
    _assert_same_run(
        read_jsonl(hf_run / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl"), f"tp{tp}pp{pp}"
    )
    _assert_same_weights(hf_run, out, f"tp{tp}pp{pp}")
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    vpp = any("virtual_pipeline" in o for o in options)
    stages = pp * (2 if vpp else 1)  # a virtual pipeline saves each chunk as its virtual stage
    assert sorted(os.listdir(ckpt / "megatron")) == sorted(
        ["layout.json"]
        + [f"tp{t:02d}_pp{p:02d}.safetensors" for t in range(tp) for p in range(stages)]
    )
    # the checkpoint describes itself (issue 26): its model's config.json and tokenizer, under its
    # checksums
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(ckpt))
    assert "config.json" in json.loads((ckpt / "checksums.json").read_text())["files"]


def test_kill_and_resume_gives_the_uninterrupted_run(folder, tmp_path):
    """SIGKILL the 4-rank TP2 x PP2 run after its first checkpoint, resume=true: the final
    metrics equal those of an uninterrupted run (bit for bit: same layout, same kernels)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    base = [*RUN, f"model.name={folder}", *_megatron(2, 2)]
    _finish(_torchrun(4, [*base, f"output_dir={full}"]))
    proc = _torchrun(4, [*base, f"output_dir={cut}"], start_new_session=True)
    deadline = time.monotonic() + WAIT_S
    while not any((cut / "checkpoints").glob("step_*")) and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rows_before = read_jsonl(cut / "metrics.jsonl") if (cut / "metrics.jsonl").exists() else []
    assert len(rows_before) < 3
    _finish(_torchrun(4, [*base, f"output_dir={cut}", "resume=true"]))
    _assert_same_run(
        read_jsonl(full / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl"), "resume", rel=0.0
    )
    s1 = json.loads((full / "summary.json").read_text())
    s2 = json.loads((cut / "summary.json").read_text())
    for k in ("eval_reward_last", "update_tokens_total", "rollout_tokens_total"):
        assert s1[k] == s2[k], k


def test_megatron_smoke_experiment_then_convert_to_hf(tmp_path):
    """The laptop Megatron experiment as the README runs it: TP 2 under torchrun on the tiny
    random model, a checkpoint of two TP shards that stays small, and the next command
    (``nemo-d3s-convert megatron-to-hf`` with no --hf-config: the checkpoint keeps the
    model's config.json and tokenizer) gives the run's own exported weights back bit for bit.
    On an empty model cache, as on a new machine (issue 32: both ranks built the tiny folder
    and the second died of the first's folder lock)."""
    from safetensors.torch import load_file

    out = tmp_path / "msmoke"
    fresh = {"NEMO_D3S_CACHE": str(tmp_path / "empty-cache")}
    log = _finish(
        _torchrun(2, ["experiment=megatron_smoke", f"output_dir={out}"], env=fresh), timeout=WAIT_S
    )
    ckpts = sorted((out / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step_000004"], ckpts  # keep_last=1
    assert sorted(os.listdir(ckpts[0] / "megatron")) == [
        "layout.json",
        "tp00_pp00.safetensors",
        "tp01_pp00.safetensors",
    ]
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size < 20e6, f"the smoke run wrote {size / 1e6:.1f} MB"
    # Megatron-core's start-up notices are filtered; the trainer's own lines remain.
    assert "Transformer Engine and Apex are not installed" not in log and "done: steps=4" in log
    hf = tmp_path / "hf"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_d3s.convert",
            "megatron-to-hf",
            "--ckpt",
            str(ckpts[0]),
            "--out",
            str(hf),
        ],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    exported, converted = (
        load_file(out / "hf_export" / "model.safetensors"),
        load_file(hf / "model.safetensors"),
    )
    assert exported.keys() == converted.keys()
    for k in exported:
        assert torch.equal(exported[k], converted[k]), k


def test_a_tp2_checkpoint_resumes_at_tp1(tmp_path):
    """Issue 32: checkpoints reshard to any layout (docs/scaling.md), but a resume at
    another TP x PP was refused as a changed experiment. The smoke run at TP 2 on two
    ranks, stopped after 2 steps, resumes at TP 1 in one process and finishes."""
    out = tmp_path / "run"
    fresh = {"NEMO_D3S_CACHE": str(tmp_path / "cache")}
    short = ["experiment=megatron_smoke", f"output_dir={out}", "trainer.export_hf=false"]
    _finish(_torchrun(2, [*short, "trainer.steps=2", "trainer.save_every=1"], env=fresh), WAIT_S)
    r = subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *short, "trainer.steps=3", "resume=true"]
        + ["model.params.tensor_model_parallel_size=1", "trainer.save_every=1"],
        cwd=REPO,
        env={**cli_env(), **fresh},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr + r.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert (out / "config.resumed-1.yaml").is_file()
