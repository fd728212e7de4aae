"""Which GPUs each vLLM engine gets (``backends/vllm/placement.py``), for every recipe's layout
and for ``slurm/train_dp.sbatch``, and the environment the engine starts in. No vLLM needed:
the placement is arithmetic, the start-up environment is read inside a stand-in for vLLM.

Before the fix every engine of a node ran on the node's first GPUs (vLLM's executors take
local ranks 0..TP-1): the 8B recipe's four TP-2 engines all on GPUs 0-1."""

from __future__ import annotations

import pytest

from nemo_d3s.backends.megatron.parallel import (
    engine_ranks_of_model_copies,
    first_ranks_of_model_copies,
    rank_order,
)
from nemo_d3s.backends.vllm.placement import engine_devices, engine_placement

# recipe -> (nodes, expected {engine rank: (node, local GPUs)})
RECIPES = {
    "llama3_8b": (1, {0: (0, [0, 1]), 2: (0, [2, 3]), 4: (0, [4, 5]), 6: (0, [6, 7])}),
    "qwen25_math_7b": (1, {0: (0, [0, 1]), 2: (0, [2, 3]), 4: (0, [4, 5]), 6: (0, [6, 7])}),
    # TP 4 x PP 4, tp-pp-dp order: each copy on 16 consecutive ranks (2 nodes), its two TP-8
    # engines (rollout_engines_per_copy 2) on the first rank of each half: every node's GPUs
    "llama3_70b": (8, {8 * k: (k, list(range(8))) for k in range(8)}),
    # the long-response recipe (rows of 16k tokens): the same layout and engines as llama3_70b;
    # the 32k one (TP 8 x PP 2 x CP 2): each CP rank's group on two nodes, an engine on each
    "llama3_70b_long": (8, {8 * k: (k, list(range(8))) for k in range(8)}),
    "llama3_70b_32k": (8, {8 * k: (k, list(range(8))) for k in range(8)}),
    # TP 8 x PP 2, default order: copies' first stages on nodes 0-3, second stages on 4-7, an
    # engine on each
    "qwen25_72b": (8, {8 * k: (k, list(range(8))) for k in range(8)}),
    # TP 8 x PP 1: one copy per node, its TP-8 engine on the node's 8 GPUs
    "qwen3_32b": (4, {8 * k: (k, list(range(8))) for k in range(4)}),
    # MoE, TP 4 x PP 1 on one node: two copies (ranks 0-3, 4-7), a TP-4 engine on each's GPUs
    "qwen3_30b_a3b": (1, {0: (0, [0, 1, 2, 3]), 4: (0, [4, 5, 6, 7])}),
    # MoE, TP 4 x PP 2, default order (tp, dp, pp): DP 8, copies' first stages on ranks 0, 4,
    # .., 28 (nodes 0-3), a TP-4 engine each; the second stages' 32 GPUs carry none
    "qwen3_235b_a22b": (
        8,
        {4 * k: (k // 2, list(range(4 * (k % 2), 4 * (k % 2) + 4))) for k in range(8)},
    ),
}


def _compose(overrides):
    from nemo_d3s.train import compose_config

    return compose_config(overrides)


def _placement(cfg, nodes: int, gpus_per_node: int = 8):
    p = cfg.model.params
    tp, pp = int(p.tensor_model_parallel_size), int(p.pipeline_model_parallel_size)
    cp = int(p.get("context_parallel_size", 1))
    dp = nodes * gpus_per_node // (tp * pp * cp)
    order = rank_order(bool(p.get("use_tp_pp_dp_mapping", False)))
    ranks = engine_ranks_of_model_copies(tp, pp, dp, order, cp, int(p.rollout_engines_per_copy))
    placed = engine_placement(
        ranks,
        gpus_per_node=gpus_per_node,
        tensor_parallel_size=int(cfg.rollout.tensor_parallel_size),
    )
    return {e.rank: (e.node, e.gpus) for e in placed}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_engine_gets_exactly_its_own_gpus(name, tmp_path):
    nodes, want = RECIPES[name]
    got = _placement(_compose([f"experiment={name}", f"output_dir={tmp_path}"]), nodes)
    assert got == want
    used = [(node, g) for node, gpus in got.values() for g in gpus]
    assert len(used) == len(set(used))  # no GPU carries two engines


def test_train_dp_sbatch_one_engine_per_rank_on_its_own_gpu():
    """slurm/train_dp.sbatch: 2 nodes x 8 ranks, every rank its own engine (HF backend,
    replicated policy): rank r on GPU r % 8 of node r // 8. A TP-2 engine per rank would
    share GPUs with its neighbour's: an error naming both."""
    placed = engine_placement(range(16), gpus_per_node=8, tensor_parallel_size=1)
    assert {e.rank: (e.node, e.gpus) for e in placed} == {r: (r // 8, [r % 8]) for r in range(16)}
    with pytest.raises(ValueError, match="engines of ranks 0 and 1 would share GPU 1 of node 0"):
        engine_placement(range(16), gpus_per_node=8, tensor_parallel_size=2)


def test_the_70b_recipe_in_default_rank_order_cannot_place_its_engines():
    ranks = first_ranks_of_model_copies(4, 4, 4, rank_order(False))  # 0, 4, 8, 12
    with pytest.raises(ValueError, match="local rank 4 needs GPUs 4..11, the node has 8"):
        engine_placement(ranks, gpus_per_node=8, tensor_parallel_size=8)


def test_engine_devices_follow_the_nodes_visible_devices():
    assert engine_devices(2, 2, gpus_on_node=8) == ["2", "3"]
    # A job given GPUs 4-7 of its node: local rank 1's TP-2 engine is on physical 5 and 6.
    assert engine_devices(1, 2, visible="4,5,6,7", gpus_on_node=4) == ["5", "6"]
    assert engine_devices(0, 1, visible="GPU-aa, GPU-bb") == ["GPU-aa"]
    with pytest.raises(ValueError, match="needs GPUs 3..4, the node has 4"):
        engine_devices(3, 2, visible="4,5,6,7")


def test_the_engine_starts_with_its_own_gpus_and_the_trainer_keeps_its_view(monkeypatch):
    """What vLLM's processes inherit while ``vllm.LLM`` starts: CUDA_VISIBLE_DEVICES = this
    rank's GPU onward (current device 2, TP 2 -> "2,3"); restored afterwards."""
    import torch

    from nemo_d3s.backends.vllm import engine as vengine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert vengine.own_gpus(2) == "2,3"
    seen = {}
    with vengine.engine_env(vengine.own_gpus(2)):
        import os

        seen["inside"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    import os

    assert seen["inside"] == "2,3" and "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3,5,7,9,11,13,15")
    assert vengine.own_gpus(2) == "5,7"


def test_the_engines_processes_do_not_inherit_one_cuda_connection(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's, set in the trainer) does not reach a process
    started while vLLM starts (its workers spawn there); the trainer keeps it afterwards."""
    import os
    import subprocess
    import sys

    from nemo_d3s.backends.vllm.launch import engine_env

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    probe = "import os; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset'))"
    with engine_env(None):
        child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert child.stdout.strip() == "unset", child.stdout + child.stderr
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_the_engines_processes_write_to_their_log_file_for_their_whole_life(tmp_path, capfd):
    """A process started while vLLM starts (its engine core) writes its stdout and stderr to
    the engine's log, also after the trainer's own streams are back (the traceback vLLM dumps
    when a stop signal ends it lands there, not beside the trainer's one line); lines already
    in the file stay."""
    import os
    import subprocess
    import sys
    import time

    from nemo_d3s.backends.vllm.launch import engine_output

    log = tmp_path / "run" / "vllm_engine.log"
    log.parent.mkdir()
    log.write_text("an earlier engine's line\n")
    child_code = (
        "import sys, time; print('child out', flush=True); print('child err', file=sys.stderr, "
        "flush=True); sys.stdin.readline(); print('Traceback (late)', file=sys.stderr)"
    )
    with engine_output(str(log)):
        child = subprocess.Popen([sys.executable, "-c", child_code], stdin=subprocess.PIPE)
        os.write(1, b"the trainer while vLLM starts\n")  # (vLLM's start-up lines here)
    print("the trainer afterwards", flush=True)
    os.write(2, b"trainer stderr afterwards\n")
    child.communicate(b"go\n", timeout=60)
    for _ in range(50):  # the child's last write is flushed at its exit
        if "late" in log.read_text():
            break
        time.sleep(0.1)
    text = log.read_text()
    assert text.startswith("an earlier engine's line\n"), text
    for line in ("child out", "child err", "Traceback (late)", "the trainer while vLLM starts"):
        assert line in text, text
    assert "afterwards" not in text, text
    seen = capfd.readouterr()
    assert "the trainer afterwards" in seen.out and "trainer stderr afterwards" in seen.err
    assert "child" not in seen.out + seen.err and "Traceback" not in seen.err


def test_the_engine_log_file_is_resolved_in_the_run_directory(tmp_path, monkeypatch):
    """``rollout.log_file``: null -> vllm_engine.log in the run directory (a rank's own name
    past rank 0), "-" -> the terminal (None), a path as given; an empty one is refused."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from nemo_d3s.backends.vllm.config import VLLMEngineConfig
    from nemo_d3s.trainer.build import engine_settings

    def cfg(log_file):
        return OmegaConf.create(
            {"output_dir": str(tmp_path), "rollout": {"engine": "vllm", "log_file": log_file}}
        )

    assert engine_settings(cfg(None))["log_file"] == str(tmp_path / "vllm_engine.log")
    assert engine_settings(cfg("-"))["log_file"] is None
    assert engine_settings(cfg("/x/e.log"))["log_file"] == "/x/e.log"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 3)
    assert engine_settings(cfg(None))["log_file"] == str(tmp_path / "vllm_engine_rank3.log")
    with pytest.raises(ValueError, match="log_file='': must be a file path"):
        VLLMEngineConfig(log_file="")


def test_the_runtime_refuses_engines_that_would_share_a_gpu(monkeypatch):
    """``engines.check_gpu_placement`` before any engine starts, on every rank alike: a
    replicated policy on 16 ranks (8 per node) builds 16 engines; TP 2 would overlap."""
    import torch
    import torch.distributed as dist

    from nemo_d3s.backends.base import Policy
    from nemo_d3s.backends.engines import check_gpu_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")

    class Replicated:
        rollout_engine_ranks = Policy.rollout_engine_ranks

    check_gpu_placement(Replicated(), {"tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="engines of ranks 0 and 1 would share GPU 1 of node 0"):
        check_gpu_placement(Replicated(), {"tensor_parallel_size": 2})

    import types

    from nemo_d3s.backends.megatron.backend import MegatronBackend

    class Megatron:  # TP 2 x PP 1 copies: engines at 0, 2, 4, ...: a TP-2 engine each fits
        layout = types.SimpleNamespace(tp=2, pp=1)
        cfg = types.SimpleNamespace(use_tp_pp_dp_mapping=False, rollout_engines_per_copy=1)
        groups = types.SimpleNamespace(cp_size=1)
        rollout_engine_ranks = MegatronBackend.rollout_engine_ranks

    assert Megatron().rollout_engine_ranks(16) == list(range(0, 16, 2))
    check_gpu_placement(Megatron(), {"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="would share GPU"):
        check_gpu_placement(Megatron(), {"tensor_parallel_size": 4})


def test_every_vllm_recipe_is_in_the_placement_table(tmp_path):
    """A recipe added under conf/experiment/ with rollout=vllm must have its placement above."""
    from pathlib import Path

    conf = Path(__file__).resolve().parents[2] / "conf" / "experiment"
    vllm = set()
    for f in sorted(conf.glob("*.yaml")):
        cfg = _compose([f"experiment={f.stem}", f"output_dir={tmp_path}"])
        # engines on GPUs apart (rollout.generation_gpus) have no place among the training ranks
        if str(cfg.rollout.engine) == "vllm" and not int(cfg.rollout.generation_gpus):
            vllm.add(f.stem)
    assert vllm == set(RECIPES)


# recipe -> GPUs with no engine while generating (RECIPES' layouts: 64 GPUs for the 70B/72B)
IDLE = {
    "llama3_8b": 0,
    "qwen25_math_7b": 0,
    "llama3_70b": 0,
    "llama3_70b_long": 0,
    "llama3_70b_32k": 0,
    "qwen25_72b": 0,
    "qwen3_32b": 0,
    "qwen3_30b_a3b": 0,
    "qwen3_235b_a22b": 32,
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_dry_run_states_every_recipes_idle_gpus_in_generation_and_why(name, tmp_path):
    """Issue 30, fix 5: where engines leave GPUs without one (235B: a TP-4 engine per 8-GPU
    copy), the dry run states how many, why, and the idle GPU-seconds per step (idle GPUs x
    the generation time, at least its decode floor). The 70B/72B recipes' 16-GPU copies have
    an engine on each node (issue 41, item 8): none idle."""
    from nemo_d3s.dry_run import JobShape, plan, render

    nodes, want = RECIPES[name]
    cfg = _compose([f"experiment={name}", f"output_dir={tmp_path}"])
    v = plan(cfg, JobShape(nodes, 8, "test"))["vllm"]
    tp = int(cfg.rollout.tensor_parallel_size)
    assert v["gpus_idle_in_generation"] == IDLE[name] == nodes * 8 - len(want) * tp
    assert v["idle_gpu_seconds_per_step_min"] == pytest.approx(IDLE[name] * v["generation_floor_s"])
    assert v["generation_floor_s"] > 0
    lines = [x for x in render(plan(cfg, JobShape(nodes, 8, "test"))).splitlines() if "idle" in x]
    if IDLE[name]:
        p = cfg.model.params
        copy = int(p.tensor_model_parallel_size) * int(p.pipeline_model_parallel_size)
        unit = "a copy" if int(p.get("context_parallel_size", 1)) == 1 else "a group"
        assert f"{unit} spans {copy} GPUs (TP x PP) and its engine {tp}" in v["idle_why"]
        assert lines and f"{IDLE[name]} GPUs idle while generating (50%)" in lines[0]
    else:
        assert v["idle_why"] == "every GPU carries an engine shard" and not lines


def test_idle_gpu_seconds_hand_worked():
    """32 idle GPUs; 1000 decode steps each reading 3.35 GB per GPU at 3.35 TB/s: 1 s floor,
    32 idle GPU-seconds per step at least."""
    from nemo_d3s.backends.vllm.memory import HBM_BYTES_PER_S, generation_idle

    assert HBM_BYTES_PER_S == 3.35e12
    g = generation_idle(
        gpus_total=64,
        gpus_with_engine=32,
        copy_gpus=16,
        vllm_tp=8,
        weight_bytes_per_gpu=3.35e9,
        decode_steps=1000,
    )
    assert g["gpus_idle_in_generation"] == 32 and g["idle_share_in_generation"] == 0.5
    assert g["generation_floor_s"] == pytest.approx(1.0)
    assert g["idle_gpu_seconds_per_step_min"] == pytest.approx(32.0)


def test_the_idle_reason_names_the_cp_ranks_groups_at_context_parallelism():
    """At CP 2 each CP rank's TP x PP group of a copy has its own engine (cp_rollouts.py): the
    reason speaks of those groups, not of the copy (TP x PP x CP GPUs)."""
    from nemo_d3s.backends.vllm.memory import generation_idle

    kw = dict(gpus_total=128, gpus_with_engine=64, copy_gpus=16, vllm_tp=8)
    kw.update(weight_bytes_per_gpu=1e9, decode_steps=10)
    one, two = generation_idle(**kw)["idle_why"], generation_idle(**kw, cp=2)["idle_why"]
    assert one.startswith("one engine per model copy: a copy spans 16 GPUs")
    assert two.startswith("one engine per context-parallel rank's TP x PP group (2 per model")
    assert "8 GPUs of each CP rank's group wait" in two
