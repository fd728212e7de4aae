"""``trainer.dry_run=true`` (nemo_d3s/dry_run/): the recipes' plans, the memory formulas on
a hand-worked case, the parameter counts against the published ones, against megatron-core
modules built on the meta device and against Megatron-LM's theoretical memory formula, and
the CLI's exit codes (0 fits, 1 does not fit, 2 cannot run).

Published parameter counts (Hugging Face model pages, safetensors "Model size"):
Llama-3.3-70B-Instruct 70.6B, Llama-3.1-8B-Instruct 8.03B, Qwen2.5-Math-7B 7.62B,
Qwen2.5-72B 72.7B; the exact values below are what config.json's shapes give.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_d3s.formats.spec import ModelSpec, padded_vocab_size
from nemo_d3s.formats.weights import Layout
from nemo_d3s.backends.megatron.param_counts import (
    local_param_count,
    meta_param_counts,
    real_param_count,
)
from nemo_d3s.config import ConfigError
from nemo_d3s.dry_run import (
    CUDA_CONTEXT_BYTES,
    GB,
    JobShape,
    Workload,
    activation_bytes,
    job_shape,
    kv_bytes_per_token,
    layer_activation_bytes,
    logits_bytes,
    megatron_lm_reference,
    plan,
    render,
)
from _limits import WAIT_S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# recipe -> (nodes, exact parameters, published count, (TP, PP, DP))
RECIPES = {
    "llama3_8b": (1, 8_030_261_248, "8.03B", (2, 1, 4)),
    "qwen25_math_7b": (1, 7_615_616_512, "7.62B", (2, 1, 4)),
    "llama3_70b": (8, 70_553_706_496, "70.6B", (4, 4, 4)),
    "qwen25_72b": (8, 72_706_203_648, "72.7B", (8, 2, 4)),
    "qwen3_32b": (4, 32_762_123_264, "32.8B", (8, 1, 4)),
}

# recipe -> (nodes, total, active, (TP, PP, DP, EP), fits at its gpu_memory_gb)
MOE_RECIPES = {
    "qwen3_30b_a3b": (1, 30_532_122_624, 3_353_032_704, (4, 1, 2, 8), True),
    "qwen3_235b_a22b": (8, 235_093_634_560, 22_190_763_520, (4, 2, 8, 32), False),
}


def _compose(overrides):
    from nemo_d3s.train import compose_config

    return compose_config(overrides)


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("NNODES", "GPUS_PER_NODE")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _cli(args, **env):
    return subprocess.run(
        [sys.executable, "-m", "nemo_d3s.train", *args],
        cwd=REPO,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


# ----------------------------------------------------------------------------- the recipes
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_parameter_count_is_the_published_one(name):
    _, exact, published, _ = RECIPES[name]
    spec = ModelSpec.from_folder(REPO / "nemo_d3s" / "recipes" / name)
    assert spec.num_params == exact
    value, unit = float(published[:-1]), published[-1]
    assert unit == "B" and round(spec.num_params / 1e9, len(published.split(".")[1]) - 1) == value


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_dry_run_fits_and_cross_checks(name, tmp_path):
    nodes, exact, _, (tp, pp, dp) = RECIPES[name]
    report = plan(
        _compose([f"experiment={name}", f"output_dir={tmp_path}"]), JobShape(nodes, 8, "test")
    )
    print(render(report))
    assert report["fits"], report["problems"]
    assert report["total_params"] == exact
    lay = report["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["world"]) == (tp, pp, dp, nodes * 8)
    assert len(report["positions"]) == tp * pp
    # Shards sum to the whole: padding dropped, the untied output layer counted, norms once.
    assert sum(x["real_params"] for x in report["positions"]) == exact
    # Every distinct position was built by megatron-core on the meta device and agreed.
    meta = report["checks"]["meta_build"]
    assert "counts" in meta, meta
    for key, n in meta["counts"].items():
        t, p = map(int, key.split(","))
        assert n == next(
            x["params"] for x in report["positions"] if (x["tp_rank"], x["pp_rank"]) == (t, p)
        )
    # each kind of stage once: the first, a middle one (PP > 2: all middles are alike), the last
    assert {k.split(",")[1] for k in meta["counts"]} == {
        str(p) for p in {0, min(1, pp - 1), pp - 1}
    }
    for x in report["positions"]:
        assert x["peak_bytes"] <= 80 * GB and x["largest_term"] in x["terms_bytes"]
        assert x["terms_bytes"]["cuda_context"] == CUDA_CONTEXT_BYTES
        assert x["terms_bytes"]["nccl"] > 0
    v = report["vllm"]
    assert v["shards_per_gpu"] == 1 and v["kv_tokens"] >= v["max_model_len"] >= v["longest_rollout"]
    # Megatron-LM's 6 + 12/DP bytes per parameter on its most loaded shard: the same
    # within the TP-replicated norms it divides by TP (and q/k/v biases it leaves out).
    ref = report["checks"]["megatron_lm_reference"]
    mine = ref["this_model_first_stage_weight_grad_optimizer_bytes"]
    assert abs(mine - ref["weight_and_optimizer_bytes"]) / mine < 2e-3


def test_70b_recipe_needs_the_tp_pp_dp_rank_order(tmp_path):
    """What the 70B recipe's comment says: at TP 4 x PP 4 in Megatron's default rank order the
    engines of the four TP x PP copies start at ranks 0, 4, 8, 12, two per node on nodes 0-1,
    where a TP-8 engine from local rank 4 would need GPUs 4..11: the layout cannot run (an
    error naming it); in tp-pp-dp order each copy holds two nodes, and its two engines
    (``rollout_engines_per_copy: 2``) start on each node's GPU 0 (fits; no GPU idle while they
    generate). One engine per copy: one per even node, the odd nodes' 32 GPUs idle."""
    report = plan(
        _compose(["experiment=llama3_70b", f"output_dir={tmp_path}"]), JobShape(8, 8, "test")
    )
    assert report["fits"] and report["layout"]["rank_order"] == "tp-cp-ep-pp-dp"
    v = report["vllm"]
    assert v["engines_per_node"] == {str(n): 1 for n in range(8)}
    assert v["shards_per_gpu"] == 1 and v["gpus_with_engine"] == 64
    assert v["engine_gpus"]["16"] == [f"node2:gpu{g}" for g in range(8)]
    assert v["engine_gpus"]["24"] == [f"node3:gpu{g}" for g in range(8)]
    assert v["gpus_idle_in_generation"] == 0 and v["rows_per_engine_step"] == 1024 // 8
    # every stage's GPU 0 carries an engine shard (stages 2-3 are the second node)
    on_engine = {
        (p["tp_rank"], p["pp_rank"]) for p in report["positions"] if "vllm" in p["terms_bytes"]
    }
    assert on_engine == {(t, s) for t in range(4) for s in range(4)}
    one = plan(
        _compose(
            [
                "experiment=llama3_70b",
                f"output_dir={tmp_path}",
                "model.params.rollout_engines_per_copy=1",
            ]
        ),
        JobShape(8, 8, "test"),
    )
    v1 = one["vllm"]
    assert v1["engines_per_node"] == {"0": 1, "2": 1, "4": 1, "6": 1}
    assert v1["gpus_idle_in_generation"] == 32 and "rollout_engines_per_copy=2" in v1["idle_why"]
    on_engine = {
        (p["tp_rank"], p["pp_rank"]) for p in one["positions"] if "vllm" in p["terms_bytes"]
    }
    assert on_engine == {(t, s) for t in range(4) for s in range(2)}
    gen_one, gen_two = (r["step_model"]["layouts"][0]["generation_s"] for r in (one, report))
    assert gen_two < 0.7 * gen_one  # 256 rollouts an engine in 3 waves of 126 -> 128 in 2
    with pytest.raises(ConfigError, match="the engine of local rank 4 needs GPUs 4..11"):
        plan(
            _compose(
                [
                    "experiment=llama3_70b",
                    f"output_dir={tmp_path}",
                    "model.params.use_tp_pp_dp_mapping=false",
                ]
            ),
            JobShape(8, 8, "test"),
        )


def test_plain_adamw_is_planned_unsharded(tmp_path):
    """distributed_optimizer=false: fp32 grads (MainWeightsAdamW's main_grad) and fp32 main
    weights + both Adam moments on every DP rank (4 P + 12 P bytes) instead of 4 P + 12 P / DP
    (a plan of 2-byte gradients chose the plain path where it costs more)."""
    base = ["experiment=llama3_8b", f"output_dir={tmp_path}"]
    dist_plan = plan(_compose(base), JobShape(1, 8, "test"))
    plain = plan(
        _compose([*base, "+model.params.distributed_optimizer=false"]), JobShape(1, 8, "test")
    )
    assert (
        dist_plan["layout"]["optimizer"] == "distributed"
        and plain["layout"]["optimizer"] == "plain AdamW"
    )
    dp = plain["layout"]["dp"]
    for a, b in zip(dist_plan["positions"], plain["positions"]):
        n = a["params"]
        assert a["terms_bytes"]["grads"] == 4 * n and a["terms_bytes"]["optimizer"] == 12 * n / dp
        assert b["terms_bytes"]["grads"] == 4 * n and b["terms_bytes"]["optimizer"] == 12 * n


def test_first_ranks_of_model_copies_hand_worked():
    from nemo_d3s.backends.megatron.parallel import (
        DEFAULT_ORDER,
        TP_PP_DP_ORDER,
        first_ranks_of_model_copies,
        global_rank_of,
    )

    # TP4 x PP4 x DP4 on 64 ranks: default rank = t + 4 (d + 4 p); tp-pp-dp rank = t + 4 (p + 4 d)
    assert first_ranks_of_model_copies(4, 4, 4, DEFAULT_ORDER) == [0, 4, 8, 12]
    assert first_ranks_of_model_copies(4, 4, 4, TP_PP_DP_ORDER) == [0, 16, 32, 48]
    assert (
        global_rank_of(3, 2, 1, tp=4, pp=4, dp=4, order=DEFAULT_ORDER) == 3 + 4 * (1 + 4 * 2) == 39
    )
    assert (
        global_rank_of(3, 2, 1, tp=4, pp=4, dp=4, order=TP_PP_DP_ORDER) == 3 + 4 * (2 + 4 * 1) == 27
    )
    for order in (DEFAULT_ORDER, TP_PP_DP_ORDER):  # a bijection onto 0..63
        ranks = {
            global_rank_of(t, p, d, tp=4, pp=4, dp=4, order=order)
            for t in range(4)
            for p in range(4)
            for d in range(4)
        }
        assert ranks == set(range(64))
    with pytest.raises(ValueError, match="rank order"):
        first_ranks_of_model_copies(2, 2, 2, "tp-dp-pp-cp")


# ----------------------------------------------------------------------------- the CLI
@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_cli_dry_run_of_the_70b_recipe_writes_its_plan(tmp_path):
    """No NNODES / GPUS_PER_NODE: the recipe's own trainer.nodes x trainer.gpus_per_node."""
    r = _cli(["experiment=llama3_70b", "trainer.dry_run=true", f"output_dir={tmp_path}"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trainer.nodes=8 x trainer.gpus_per_node=8" in r.stdout
    assert "verdict: FITS in 80 GB per GPU" in r.stdout
    assert "TP 4 x PP 4 x DP 4 (ranks tp-cp-ep-pp-dp)" in r.stdout
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["total_params"] == 70_553_706_496 and report["fits"] is True
    assert report["layout"]["world"] == 64 and report["layout"]["vllm_tp"] == 8
    assert len(report["positions"]) == 16
    for x in report["positions"]:
        assert {"tp_rank", "pp_rank", "params", "terms_bytes", "peak_bytes", "fits"} <= set(x)
        assert {"weights", "grads", "optimizer", "activations"} <= set(x["terms_bytes"])
        # a copy's two TP-8 engines run on its ranks 0-7 and 8-15: every stage carries a shard
        assert "vllm" in x["terms_bytes"], x
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing was trained


def _run_in_process(overrides, monkeypatch, capsys, **env):
    """The dry run as the CLI runs it after Hydra (train.run_cli), in this process:
    (exit code, stdout, stderr)."""
    from nemo_d3s.train import run_cli

    for k in [k for k in os.environ if k.startswith("SLURM_")] + ["NNODES", "GPUS_PER_NODE"]:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = run_cli(_compose(overrides))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_70b_at_tp1_does_not_fit_and_says_why(tmp_path, monkeypatch, capsys):
    rc, out, err = _run_in_process(
        [
            "experiment=llama3_70b",
            "trainer.dry_run=true",
            f"output_dir={tmp_path}",
            "model.params.tensor_model_parallel_size=1",
            "model.params.pipeline_model_parallel_size=1",
            "rollout.tensor_parallel_size=1",
            "model.params.rollout_engines_per_copy=1",
        ],  # one engine per rank: one GPU each
        monkeypatch,
        capsys,
        NNODES="8",
        GPUS_PER_NODE="8",
    )
    assert rc == 1, out + err
    assert "verdict: DOES NOT FIT in 80 GB per GPU" in out
    # The reason: the whole model's state on one GPU (bf16 weights 141 GB, fp32 grads 282 GB).
    assert "problem: the training state alone needs 436.6 GB per GPU" in out
    assert "weights 141.1 + grads 282.2" in out and "largest term: grads" in out
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["fits"] is False and report["worst"]["largest_term"] == "grads"


def test_layout_that_cannot_run_is_an_error_naming_the_job_shape(tmp_path, monkeypatch, capsys):
    # NNODES overrides the recipe's 8 nodes: 1 node x the recipe's 8 GPUs.
    rc, out, err = _run_in_process(
        ["experiment=llama3_70b", "trainer.dry_run=true", f"output_dir={tmp_path}"],
        monkeypatch,
        capsys,
        NNODES="1",
    )
    assert rc == 2, out + err
    assert (
        "error: world size 8 is not divisible by tensor_model_parallel_size x "
        "pipeline_model_parallel_size = 16 (world = NNODES=1 x trainer.gpus_per_node=8"
    ) in err
    assert not (tmp_path / "dry_run.json").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["rollout.tensor_parallel_size=3"],
            "rollout.tensor_parallel_size=3: does not divide num_attention_heads=64",
        ),
        (
            ["trainer.prompts_per_step=6"],
            "trainer.prompts_per_step=6: must be divisible by the number of data-parallel",
        ),
        (
            ["rollout.max_model_len=2048"],
            "task.max_prompt_tokens=1024 + 2048 new tokens = 3072 exceeds "
            "rollout.max_model_len (2048)",
        ),
        (  # each CP rank's TP-4 group has an engine (cp_rollouts.py): TP-8 engines overlap
            ["+model.params.context_parallel_size=2"],
            "rollout.tensor_parallel_size=8: the engine of local rank 4 needs GPUs 4..11, "
            "the node has 8",
        ),
        (["+model.params.sequence_packing=true"], "packed (THD) sequences"),
        (
            [
                "model.params.tensor_model_parallel_size=16",
                "model.params.pipeline_model_parallel_size=1",
            ],
            "num_key_value_heads=8 is not divisible by tensor_model_parallel_size=16",
        ),
        (
            ["rollout.tensor_parallel_size=16"],
            "rollout.tensor_parallel_size=16: exceeds the 8 GPUs of a node",
        ),
        (["model.backend=hf"], "trainer.dry_run plans Megatron layouts"),
        (["trainer.gpu_memory_gb=0"], "trainer.gpu_memory_gb=0"),
    ],
)
def test_layout_rules_are_config_errors(tmp_path, overrides, message):
    cfg = _compose(["experiment=llama3_70b", f"output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan(cfg, JobShape(8, 8, "test"))


def test_a_check_the_backend_adds_is_in_the_plan(tmp_path, monkeypatch):
    """The plan goes through the backend's own option check (``check_config``, reached via
    the trainer's ``checked_backend_config``), so a refusal added to the backend refuses the
    plan too, with the trainer's message."""
    from nemo_d3s.backends.megatron.backend import MegatronBackend

    cfg = _compose(["experiment=llama3_70b", f"output_dir={tmp_path}"])
    assert plan(cfg, JobShape(8, 8, "test"))["fits"]

    def refuse(config):
        raise ValueError(
            f"model.params.entropy_chunk_size={config.entropy_chunk_size}: refused by a new check"
        )

    monkeypatch.setattr(MegatronBackend, "check_config", staticmethod(refuse))
    with pytest.raises(
        ConfigError,
        match=re.escape("model: model.params.entropy_chunk_size=1024: refused by a new"),
    ):
        plan(cfg, JobShape(8, 8, "test"))


def test_job_shape_from_the_environment():
    assert job_shape({}) == JobShape(1, 8, "NNODES=1 (default) x GPUS_PER_NODE=8 (default)")
    assert job_shape({"NNODES": "8", "GPUS_PER_NODE": "4"}).world == 32
    assert job_shape({"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}).world == 16
    assert job_shape({"NNODES": "3", "SLURM_JOB_NUM_NODES": "2"}).nodes == 3
    with pytest.raises(ConfigError, match="NNODES='x'"):
        job_shape({"NNODES": "x"})
    # A recipe's shape fills in what the environment does not set; the environment wins.
    assert job_shape({}, nodes=8, gpus_per_node=4) == JobShape(
        8, 4, "trainer.nodes=8 x trainer.gpus_per_node=4"
    )
    assert job_shape({"SLURM_JOB_NUM_NODES": "2"}, nodes=8, gpus_per_node=4).world == 8
    assert job_shape({"GPUS_PER_NODE": "2"}, nodes=8).world == 16
    with pytest.raises(ConfigError, match="trainer.nodes=0"):
        job_shape({}, nodes=0)


# recipes on the 70B layout of another kind (long rows; the engines apart, overlapped)
VARIANTS = ("llama3_70b_long", "llama3_70b_32k", "llama3_70b_async")


@pytest.mark.parametrize("name", sorted(RECIPES) + list(VARIANTS) + sorted(MOE_RECIPES))
def test_every_recipe_states_the_cluster_shape_it_is_planned_for(name):
    cfg = _compose([f"experiment={name}", "output_dir=x"])
    if name in MOE_RECIPES:
        nodes, layout = MOE_RECIPES[name][0], MOE_RECIPES[name][3][:3]
    else:
        nodes, layout = (8, (4, 4, 4)) if name in VARIANTS else (RECIPES[name][0], RECIPES[name][3])
    assert (cfg.trainer.nodes, cfg.trainer.gpus_per_node) == (nodes, 8)
    tp, pp, dp = layout
    assert tp * pp * dp == cfg.trainer.nodes * cfg.trainer.gpus_per_node


def test_every_planned_recipe_file_is_in_the_shape_test():
    """A new recipe (a conf/experiment file on the Megatron model with a dry-run line) must
    state its shape too: it is listed above."""
    conf = REPO / "conf" / "experiment"
    planned = {f.stem for f in conf.glob("*.yaml") if "trainer.dry_run=true" in f.read_text()}
    assert planned == set(RECIPES) | set(VARIANTS) | set(MOE_RECIPES), planned


# ----------------------------------------------------------------------------- formulas by hand
def _tiny_config(tied=False, bias=False):
    """h 64, 4 heads of 16, 2 KV heads, FFN 96, 4 layers, vocabulary 300."""
    return {
        "architectures": ["Qwen2ForCausalLM" if bias else "LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
    }


def _tiny(tied=False, bias=False):
    return ModelSpec.from_hf_dict(_tiny_config(tied, bias))


def test_parameters_by_hand():
    spec = _tiny()
    # per layer: qkv 16 x (4 + 2 x 2) x 64 = 8192, proj 4096, fc1 2 x 96 x 64 = 12288,
    # fc2 6144, two norms 128 -> 30848; whole model 4 x 30848 + 2 x 300 x 64 + 64 = 161856.
    assert spec.num_params == 161_856
    vp = padded_vocab_size(300, 2)  # 128 x TP 2 = 256 -> 512 rows, 256 per TP rank
    assert vp == 512
    # TP 2 x PP 2, one layer at TP 2: 4096 + 2048 + 6144 + 3072 + 128 = 15488.
    lay = Layout(tp=2, pp=2, tp_rank=0, pp_rank=0, padded_vocab=vp)
    assert (
        local_param_count(spec, lay) == 256 * 64 + 2 * 15488
    )  # embedding shard + 2 layers = 47360
    assert (
        local_param_count(spec, lay.at(1, 1)) == 2 * 15488 + 64 + 256 * 64
    )  # + final norm + output layer
    # Real share: TP rank 0 holds 256 real embedding rows, TP rank 1 holds 44 (300 - 256) + 212
    # padding; TP rank 1 skips the replicated norms.
    assert real_param_count(spec, lay) == 256 * 64 + 2 * 15488
    assert real_param_count(spec, lay.at(1, 0)) == 44 * 64 + 2 * (15488 - 128)
    total = sum(real_param_count(spec, lay.at(t, p)) for t in range(2) for p in range(2))
    assert total == spec.num_params


@pytest.mark.parametrize(
    "tied,bias", [(False, False), (True, True)], ids=["llama-untied", "qwen2-tied-bias"]
)
@pytest.mark.parametrize(
    "tp,pp,order",
    [
        (1, 1, "tp-cp-ep-dp-pp"),
        (2, 2, "tp-cp-ep-dp-pp"),
        (2, 1, "tp-cp-ep-dp-pp"),
        (1, 4, "tp-cp-ep-dp-pp"),
        (2, 2, "tp-cp-ep-pp-dp"),
    ],
)
def test_table_equals_megatron_modules_and_shards_sum(tied, bias, tp, pp, order):
    """(meta_param_counts also checks that megatron-core puts each built position, and the
    last copy's first rank, where ``parallel.global_rank_of`` says for that rank order)"""
    spec = _tiny(tied, bias)
    vp = padded_vocab_size(spec.vocab_size, tp)
    meta = meta_param_counts(spec, tp=tp, pp=pp, world=tp * pp * 2, padded_vocab=vp, order=order)
    assert "counts" in meta, meta
    for key, n in meta["counts"].items():
        t, p = map(int, key.split(","))
        assert n == local_param_count(
            spec, Layout(tp=tp, pp=pp, tp_rank=t, pp_rank=p, padded_vocab=vp)
        ), key
    total = sum(
        real_param_count(spec, Layout(tp=tp, pp=pp, tp_rank=t, pp_rank=p, padded_vocab=vp))
        for t in range(tp)
        for p in range(pp)
    )
    assert total == spec.num_params


def test_activation_and_logit_bytes_by_hand():
    spec = _tiny()
    # one layer, b 2, s 10, TP 2, bf16: s b 2 [4 h + (2 d_h (a + g) + 3 F) / t]
    #   = 40 x [256 + (2 x 16 x 6 + 288) / 2] = 40 x 496 = 19840
    assert layer_activation_bytes(64, 4, 2, 16, 96, b=2, s=10, tp=2) == 19840
    w = Workload(
        seq_len=10,
        gen_len=12,
        micro_batch=2,
        logprob_micro_batch=4,
        micro_batches=5,
        rows_per_engine=8,
        recompute=False,
        dtype_bytes=2,
        chunk=1024,
    )
    # PP 2: 2 layers per stage; 1F1B: stage 0 holds min(2 - 0, 5) = 2 micro-batches, stage 1 one.
    assert activation_bytes(spec, w, tp=2, pp=2, stage=0) == (2 * 2 * 19840, 2)
    assert activation_bytes(spec, w, tp=2, pp=2, stage=1) == (1 * 2 * 19840, 1)
    # Fewer micro-batches than stages: only as many in flight.
    assert (
        activation_bytes(spec, Workload(**{**w.__dict__, "micro_batches": 1}), tp=2, pp=2, stage=0)[
            1
        ]
        == 1
    )
    # Full recompute: each layer's input (s b h x 2 bytes = 2560) per layer and micro-batch,
    # plus one layer's full set while it is recomputed: 2 x 2 x 2560 + 19840.
    rc = Workload(**{**w.__dict__, "recompute": True})
    assert activation_bytes(spec, rc, tp=2, pp=2, stage=0) == (2 * 2 * 2560 + 19840, 2)
    # Logits on 512 / 2 = 256 vocabulary columns per TP rank: training keeps logits + their
    # gradient + GPTModel's batch-first copy (3 x 2 bytes x 2 rows x 10 x 256 = 30720), scoring
    # 4 rows + their copy (2 x 2 bytes x 4 x 10 x 256 = 40960: larger, scoring is reported);
    # workspace 3 fp32 buffers of min(1024, 4 x 10) rows x 256.
    got, which = logits_bytes(512, w, tp=2)
    assert got == 40960 + 3 * 4 * 40 * 256 and which.startswith("scoring")
    # KV cache per token per GPU, 70B shape (80 layers, 8 KV heads of 128) at vLLM TP 8:
    # K and V x 80 layers x 1 head x 128 x 2 bytes = 40960; at TP 16 the heads are replicated.
    big = ModelSpec.from_folder(REPO / "nemo_d3s" / "recipes" / "llama3_70b")
    assert kv_bytes_per_token(big, 8, 2) == 40960 == kv_bytes_per_token(big, 16, 2)


def test_memory_terms_of_a_tiny_plan_by_hand(tmp_path):
    """A plan end to end on a config-only folder: TP 2 x PP 2 on 1 x 8 GPUs (DP 2), bf16,
    no vLLM: every term of (TP 0, PP 0) from the numbers above."""
    spec = _tiny()
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_tiny_config()))
    cfg = _compose(
        [
            "model=megatron",
            f"model.name={folder}",
            "model.dtype=bfloat16",
            "model.params.tensor_model_parallel_size=2",
            "model.params.pipeline_model_parallel_size=2",
            "trainer.prompts_per_step=4",
            "trainer.num_generations=4",
            "trainer.max_new_tokens=6",
            "task.max_prompt_tokens=4",
            "trainer.micro_batch_size=2",
            "trainer.logprob_micro_batch_size=4",
            f"output_dir={tmp_path / 'out'}",
        ]
    )
    report = plan(cfg, JobShape(1, 8, "test"))
    x = next(p for p in report["positions"] if (p["tp_rank"], p["pp_rank"]) == (0, 0))
    n = 47360
    assert x["params"] == n
    t = x["terms_bytes"]
    assert t["weights"] == 2 * n and t["grads"] == 4 * n and t["optimizer"] == 12 * n // 2  # DP 2
    # 16 rows per step / DP 2 = 8 per rank -> 4 micro-batches of 2; s = 4 + 6 = 10.
    assert report["workload"]["micro_batches"] == 4 and report["workload"]["seq_len"] == 10
    assert t["activations"] == 2 * 2 * 19840
    # rollout=hf: the HF sampler's full replica (2 x 161856 bytes), and while it generates its
    # KV cache: the 8 rows of its DP replica x 10 tokens x (2 x 4 layers x 2 KV heads x 16 x 2
    # bytes).
    assert t["hf_replica"] == 2 * spec.num_params and t["hf_kv_cache"] == 8 * 10 * 512
    assert (
        "logits" not in t
        and "logits" in next(p for p in report["positions"] if p["pp_rank"] == 1)["terms_bytes"]
    )
    # NCCL: world, DP, DP-with-CP, TP and PP communicators (untied: no embedding group), each
    # 2 receive buffers x 32 channels x 4 MiB = 256 MiB
    assert t["nccl"] == 5 * 2 * 32 * 4 * 2**20 and t["cuda_context"] == CUDA_CONTEXT_BYTES
    # NVLS on the 8-GPU node: 16 channels x 2 x 1 MiB per rank of each group on the node:
    # world 8, DP 2 (ranks 0, 2), DP-with-CP 2, TP 2, PP 2 (ranks 0, 4)
    assert t["nvls"] == 16 * 2 * 2**20 * (8 + 2 + 2 + 2 + 2)
    resident = t["weights"] + t["grads"] + t["optimizer"] + t["hf_replica"]
    resident += t["cuda_context"] + t["nccl"] + t["nvls"]
    assert t["fragmentation"] == int(0.1 * t["activations"])  # no logits on stage 0
    assert x["train_peak_bytes"] == resident + t["activations"] + t["fragmentation"]
    assert x["generation_peak_bytes"] == resident + t["hf_kv_cache"]
    assert (
        "hf_replica" not in next(p for p in report["positions"] if p["tp_rank"] == 1)["terms_bytes"]
    )
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # what the sbatch scripts pass through
    try:
        off = plan(cfg, JobShape(1, 8, "test"))
    finally:
        del os.environ["NCCL_NVLS_ENABLE"]
    y = next(p for p in off["positions"] if (p["tp_rank"], p["pp_rank"]) == (0, 0))
    assert "nvls" not in y["terms_bytes"]
    assert y["train_peak_bytes"] == x["train_peak_bytes"] - t["nvls"]


@pytest.mark.parametrize("tp,pp,dp,gpus", [(2, 2, 2, 8), (4, 4, 4, 8), (8, 2, 4, 8), (1, 4, 2, 4)])
@pytest.mark.parametrize("tp_pp_dp", [False, True])
@pytest.mark.parametrize("cp", [1, 2])
def test_node_ranks_of_groups_by_enumerating_the_ranks(tp, pp, dp, gpus, tp_pp_dp, cp):
    """The members of rank 0's groups on its node, from the closed form, against the ranks
    enumerated in Megatron's order (rank = t + TP (c + CP (d + DP p)), or
    t + TP (c + CP (p + PP d)))."""
    from nemo_d3s.dry_run.memory import node_ranks_of_groups

    def rank(t, p, d, c=0):
        tc = t + tp * c
        return tc + tp * cp * (p + pp * d) if tp_pp_dp else tc + tp * cp * (d + dp * p)

    def on_node(ranks):
        return sum(1 for r in set(ranks) if r // gpus == 0)

    got = node_ranks_of_groups(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        dp_stride=rank(0, 0, 1),
        pp_stride=rank(0, 1, 0),
        gpus_per_node=gpus,
    )
    want = {
        "world": on_node(range(tp * pp * dp * cp)),
        "dp": on_node(rank(0, 0, d) for d in range(dp)),
        "dp_with_cp": on_node(rank(0, 0, d, c) for d in range(dp) for c in range(cp)),
        "tp": on_node(rank(t, 0, 0) for t in range(tp)),
        "pp": on_node(rank(0, p, 0) for p in range(pp)),
        "cp": on_node(rank(0, 0, 0, c) for c in range(cp)),
        "embedding": on_node([rank(0, 0, 0), rank(0, pp - 1, 0)]) if pp > 1 else 1,
    }
    assert got == want


def test_megatron_lm_reference_equals_this_model_at_tp1():
    """At TP 1 (no replicated norms) and without q/k/v biases the two weight + optimizer
    counts are the same number; activations differ by the stated per-layer formulas."""
    spec = ModelSpec.from_folder(REPO / "nemo_d3s" / "recipes" / "llama3_70b")
    vp = padded_vocab_size(spec.vocab_size, 1)
    ref = megatron_lm_reference(
        spec, padded_vocab=vp, tp=1, pp=1, dp=64, b=1, s=3072, micro_batches=16
    )
    n = local_param_count(spec, Layout(tp=1, pp=1, padded_vocab=vp))
    assert (
        ref["params_most_loaded_shard"] == n == spec.num_params
    )  # 128256 is already a multiple of 128
    assert ref["weight_and_optimizer_bytes"] == pytest.approx(n * (2 + 4 + 12 / 64), rel=1e-12)
    # Per layer and token: 10 h + 24 h / t there; 4 h + (2 d_h (a + g) + 3 F) / t here, x 2 bytes.
    theirs = 8192 * (10 + 24)
    mine = 2 * (4 * 8192 + 2 * 128 * (64 + 8) + 3 * 28672)
    assert layer_activation_bytes(8192, 64, 8, 128, 28672, b=1, s=1, tp=1) == mine
    assert (theirs, mine) == (278528, 274432)  # 1.5% apart for Llama-70B at TP 1


def test_vllm_cache_too_small_for_one_sequence_does_not_fit(tmp_path):
    """vLLM refuses to start when its KV cache cannot hold one max_model_len sequence; the
    model's own 131072 positions apply when rollout.max_model_len is unset."""
    cfg = _compose(
        ["experiment=llama3_70b", f"output_dir={tmp_path}", "rollout.max_model_len=null"]
    )
    report = plan(cfg, JobShape(8, 8, "test"))
    v = report["vllm"]
    assert (
        v["max_model_len"] == 131072 and v["kv_tokens"] >= 131072 and report["fits"]
    )  # 388052 tokens
    cfg = _compose(
        ["experiment=llama3_70b", f"output_dir={tmp_path}", "rollout.gpu_memory_utilization=0.215"]
    )
    report = plan(cfg, JobShape(8, 8, "test"))
    assert not report["fits"] and report["vllm"]["kv_tokens"] < 3072
    assert any("cannot hold one sequence of max_model_len=3072" in p for p in report["problems"]), (
        report["problems"]
    )


def test_vllm_gpus_count_what_stays_resident(tmp_path):
    """The 8B recipe (engines on GPUs 0-1, 2-3, ...: every GPU carries one engine worker):
    while the policy trains the sleeping engine keeps its CUDA context, TP communicator and
    CUDA graphs; generation sees the training state + the awake engine (vLLM's share, its
    context and communicator) only, because the trainer
    empties its CUDA cache before the engine wakes (with its cache kept: the train peak + vLLM,
    93 GB, which does not fit); a refit holds the engine's weights + staging buffer + gathered
    tensors. CUDA graphs off: the graphs' pool is not counted; sleep off: vLLM's whole share
    stays while the policy trains."""
    from nemo_d3s.backends.vllm.memory import CUDA_GRAPH_BYTES, VLLM_COMM_BYTES, VLLM_CONTEXT_BYTES

    def first(extra=()):
        r = plan(
            _compose(["experiment=llama3_8b", f"output_dir={tmp_path}", *extra]),
            JobShape(1, 8, "test"),
        )
        return r, next(p for p in r["positions"] if (p["tp_rank"], p["pp_rank"]) == (0, 0))

    report, x = first()
    t, v = x["terms_bytes"], report["vllm"]
    assert v["engine_gpus"] == {
        str(r): [f"node0:gpu{r}", f"node0:gpu{r + 1}"] for r in (0, 2, 4, 6)
    }
    engine_nvls = 16 * 2 * 2**20 * 2  # the engine's TP-2 communicator on NVLS
    assert t["vllm_asleep"] == VLLM_CONTEXT_BYTES + VLLM_COMM_BYTES + engine_nvls + CUDA_GRAPH_BYTES
    # awake: vLLM's share of the GPU + what its worker made before measuring it
    assert t["vllm"] == int(
        v["reserved_bytes"] + VLLM_CONTEXT_BYTES + VLLM_COMM_BYTES + engine_nvls
    )
    resident = sum(t[k] for k in ("weights", "grads", "optimizer", "cuda_context", "nccl", "nvls"))
    assert x["train_peak_bytes"] == pytest.approx(
        resident + t["activations"] + t["logits"] + t["fragmentation"] + t["vllm_asleep"], abs=8
    )
    assert x["generation_peak_bytes"] == pytest.approx(resident + t["vllm"], abs=8)
    kept = x["generation_peak_if_cache_kept_bytes"]
    assert (
        kept == pytest.approx(x["train_peak_bytes"] - t["vllm_asleep"] + t["vllm"], abs=8)
        and kept > 80 * GB
    )
    rb = v["refit_bytes"]
    assert (
        rb["staging"] == rb["held"] == max(512 * 2**20, 2 * 4096 * 128256)
    )  # the embedding is one bucket
    # the engine copies the bucket out of the staging buffer (it never keeps a view into a
    # buffer the trainer refills): one more bucket on the GPU during a refit
    assert rb["engine_copy"] == rb["staging"]
    assert x["refit_peak_bytes"] == pytest.approx(
        resident + t["vllm_asleep"] + sum(rb.values()), abs=8
    )
    _, eager = first(["rollout.enforce_eager=true"])
    assert eager["terms_bytes"]["vllm_asleep"] == t["vllm_asleep"] - CUDA_GRAPH_BYTES
    _, awake = first(["rollout.sleep=false"])
    assert awake["terms_bytes"]["vllm_asleep"] == t["vllm"]


def test_vllm_share_is_of_the_physical_gpu_not_of_gpu_memory_gb(tmp_path):
    """vLLM 0.33 reserves ``gpu_memory_utilization x`` the total memory CUDA reports
    (``v1/worker/utils.py:724-726``): an "80 GB" H100 has 81,559 MiB = 85.52 GB (NVML), so at
    0.5 vLLM holds 42.76 GB, not 40. A size not in the table is taken as the physical one."""
    from nemo_d3s.dry_run.memory import physical_gpu_bytes

    assert physical_gpu_bytes(80) == 81559 * 2**20 == 85_520_809_984
    assert physical_gpu_bytes(141) == 143771 * 2**20 and physical_gpu_bytes(96) == 96 * GB

    def vllm(gb):
        cfg = _compose(
            ["experiment=llama3_8b", f"output_dir={tmp_path}", f"trainer.gpu_memory_gb={gb}"]
        )
        return plan(cfg, JobShape(1, 8, "test"))["vllm"]

    v = vllm(80)
    gmu = v["utilization"]
    assert v["physical_gpu_bytes"] == 85_520_809_984
    assert v["reserved_bytes"] == pytest.approx(gmu * 85_520_809_984)
    assert v["reserved_bytes"] > gmu * 80 * GB + 2 * GB * gmu
    assert vllm(96)["reserved_bytes"] == pytest.approx(gmu * 96 * GB)


def test_nccl_communicators_by_layout():
    from nemo_d3s.dry_run.memory import nccl_bytes, nccl_communicators

    per = 2 * 32 * 4 * 2**20  # 256 MiB
    assert nccl_communicators(tp=1, pp=1, dp=1, tied_embeddings=True) == {}
    assert nccl_bytes(tp=8, pp=1, dp=1, tied_embeddings=True) == 2 * per  # world, TP
    # 70B: TP 8 x PP 4 x DP 2, untied: world, DP, DP-with-CP, TP, PP
    assert nccl_bytes(tp=8, pp=4, dp=2, tied_embeddings=False) == 5 * per
    assert nccl_bytes(tp=8, pp=4, dp=2, tied_embeddings=True) == 6 * per


# ----------------------------------------------------------------------------- long sequences
def test_sequence_parallel_and_token_budget_terms_by_hand():
    from nemo_d3s.dry_run.sequence import (
        micro_batches_per_step,
        replicated_share,
        tokens_per_micro_batch,
    )

    # SP splits the replicated 4 h term over TP:
    # 20 tokens x 2 bytes x [4 x 64 / 2 + (2 x 16 x 6 + 288) / 2]
    assert layer_activation_bytes(
        64, 4, 2, 16, 96, b=2, s=10, tp=2, sequence_parallel=True
    ) == 40 * (128 + 240)
    assert (
        replicated_share(4, True) == 0.25
        and replicated_share(1, True) == replicated_share(4, False) == 1.0
    )
    # tokens per micro-batch: rows x seq_len, or the budget, or one row longer than it
    assert tokens_per_micro_batch(2, 10) == 20
    assert tokens_per_micro_batch(2, 10, 15) == 15 and tokens_per_micro_batch(2, 10, 5) == 10
    # micro-batches per step with every row at seq_len: whole rows per budget, at least one
    assert micro_batches_per_step(8, 10, 2) == 4
    assert micro_batches_per_step(8, 10, 2, 35) == 3 and micro_batches_per_step(8, 10, 2, 5) == 8
    spec = _tiny()
    w = Workload(
        seq_len=10,
        gen_len=12,
        micro_batch=2,
        logprob_micro_batch=4,
        micro_batches=5,
        rows_per_engine=8,
        recompute=True,
        dtype_bytes=2,
        chunk=1024,
        sequence_parallel=True,
    )
    # full recompute under SP: each layer's input split over TP (2560 / 2) + one layer's full set
    assert activation_bytes(spec, w, tp=2, pp=2, stage=0) == (2 * 2 * 1280 + 40 * 368, 2)
    # a budget of 35 tokens: 35 x 2 bytes x 368 per layer-token
    b = Workload(**{**w.__dict__, "recompute": False, "micro_batch_tokens": 35})
    assert b.train_tokens == 35 and activation_bytes(spec, b, tp=2, pp=2, stage=1) == (
        2 * 35 * 2 * 368,
        1,
    )


def _tiny_tp2pp2(tmp_path):
    """Overrides of a TP 2 x PP 2 plan of the tiny config-only model: 16 rows of 10 tokens."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_tiny_config()))
    return [
        "model=megatron",
        f"model.name={folder}",
        "model.dtype=bfloat16",
        "model.params.tensor_model_parallel_size=2",
        "model.params.pipeline_model_parallel_size=2",
        "trainer.prompts_per_step=4",
        "trainer.num_generations=4",
        "trainer.max_new_tokens=6",
        "task.max_prompt_tokens=4",
        "trainer.micro_batch_size=2",
        f"output_dir={tmp_path / 'out'}",
    ]


def test_plan_counts_sequence_parallel_activations(tmp_path):
    base = _tiny_tp2pp2(tmp_path)
    off = plan(_compose(base), JobShape(1, 8, "test"))
    on = plan(_compose([*base, "+model.params.sequence_parallel=true"]), JobShape(1, 8, "test"))
    assert on["workload"]["sequence_parallel"] and not off["workload"]["sequence_parallel"]
    act = [r["positions"][0]["terms_bytes"]["activations"] for r in (off, on)]
    assert act == [2 * 2 * 19840, 2 * 2 * 40 * 368]
    assert off["context_parallel_needed"] == on["context_parallel_needed"] == []


def test_plan_reports_when_only_context_parallelism_would_fit(tmp_path):
    """Rows of 131k tokens on the 70B recipe: one row per micro-batch with SP and full
    recompute still exceeds 80 GB on the first stage; the dry run says to split the rows
    with context parallelism."""
    cfg = _compose(
        [
            "experiment=llama3_70b",
            f"output_dir={tmp_path}",
            "rollout.max_model_len=null",
            "trainer.max_new_tokens=129000",
        ]
    )  # the recipe runs sequence parallelism
    report = plan(cfg, JobShape(8, 8, "test"))
    assert not report["fits"]
    need = report["context_parallel_needed"]
    assert need and need[0]["position"] == "(TP 0, PP 0)" and need[0]["seq_len"] == 130024
    assert any(
        "model.params.context_parallel_size" in p and "130024 tokens" in p
        for p in report["problems"]
    )


def test_context_parallelism_divides_each_gpus_tokens(tmp_path):
    """The long-response recipe at CP 2 (rollout=hf: the engines are the policy's own): DP
    halves, each GPU holds half of every micro-batch's tokens (activations and logits
    halve), the distributed optimizer still shards over DP x CP = 16, a CP communicator is
    added."""
    base = ["experiment=llama3_70b_long", f"output_dir={tmp_path}", "rollout=hf"]
    one = plan(_compose(base), JobShape(8, 8, "test"))
    two = plan(_compose([*base, "+model.params.context_parallel_size=2"]), JobShape(8, 8, "test"))
    assert (one["layout"]["dp"], two["layout"]["dp"], two["layout"]["cp"]) == (4, 2, 2)
    first = [
        next(x for x in r["positions"] if (x["tp_rank"], x["pp_rank"]) == (0, 0))["terms_bytes"]
        for r in (one, two)
    ]
    assert first[1]["activations"] * 2 == first[0]["activations"]
    assert first[1]["optimizer"] == first[0]["optimizer"]
    assert first[1]["nccl"] - first[0]["nccl"] == 2 * 32 * 4 * 2**20  # one communicator more
    last = [
        next(x for x in r["positions"] if x["pp_rank"] == 3)["terms_bytes"]["logits"]
        for r in (one, two)
    ]
    assert 0.5 < last[1] / last[0] < 0.55  # halved, but for the kernel's fixed workspace
    assert "TP 4 x PP 4 x CP 2 x DP 2" in render(two)


def test_long_response_70b_recipe_fits_only_with_sequence_parallelism(tmp_path):
    """experiment=llama3_70b_long (rows of 16384 tokens, responses of 15360): fits 80 GB on
    8 x 8 GPUs with SP, full recompute and 32768-token micro-batches, as its comment says;
    without SP the same budget does not fit (stage 0's activations)."""
    report = plan(
        _compose(["experiment=llama3_70b_long", f"output_dir={tmp_path}"]), JobShape(8, 8, "test")
    )
    print(render(report))
    assert report["fits"], report["problems"]
    w = report["workload"]
    assert (
        w["seq_len"] == 16384
        and w["seq_len"] - 1024 >= 8192
        and w["sequence_parallel"]
        and w["recompute"]
    )
    assert w["micro_batch_tokens"] == 32768 and report["context_parallel_needed"] == []
    first = next(x for x in report["positions"] if (x["tp_rank"], x["pp_rank"]) == (0, 0))
    assert (
        round(first["terms_bytes"]["activations"] / GB, 1) == 13.0
        and round(first["train_peak_bytes"] / GB, 1) == 58.9
    )
    assert (
        round(report["worst"]["peak_bytes"] / GB, 1) == 78.9
        and report["vllm"]["kv_tokens"] >= 16384
    )
    no_sp = plan(
        _compose(
            [
                "experiment=llama3_70b_long",
                f"output_dir={tmp_path}",
                "model.params.sequence_parallel=false",
            ]
        ),
        JobShape(8, 8, "test"),
    )
    assert not no_sp["fits"] and no_sp["worst"]["largest_term"] == "activations"
    assert round(no_sp["worst"]["peak_bytes"] / GB, 1) == 96.1


def _busiest_stage0(report):
    return next(x for x in report["positions"] if (x["tp_rank"], x["pp_rank"]) == (0, 0))


def test_long_recipe_plans_without_context_parallelism_for_the_reasons_its_file_gives(
    tmp_path, monkeypatch, capsys
):
    """experiment=llama3_70b_long keeps CP 1 (its comment): the peak is generation, the
    resident state beside vLLM's share, which CP does not lower; CP 2 halves stage 0's
    activations, but with vLLM each CP rank's TP x PP group has its own engine
    (cp_rollouts.py), the groups 4 GPUs apart: the recipe's TP-8 engines would overlap, and
    TP-4 engines (as many as at CP 1: world / (TP x PP)) hold 70B's weights with no room for a
    KV cache; TP 4 x PP 2 x CP 2 does not fit the memory."""
    from nemo_d3s.dry_run.memory import RESIDENT

    rc, out, err = _run_in_process(
        ["experiment=llama3_70b_long", "trainer.dry_run=true", f"output_dir={tmp_path}"],
        monkeypatch,
        capsys,
    )
    assert rc == 0, out + err
    assert "TP 4 x PP 4 x DP 4 (ranks tp-cp-ep-pp-dp)" in out and " x CP " not in out
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["layout"]["cp"] == 1 and report["workload"]["cp"] == 1
    worst, first = report["worst"], _busiest_stage0(report)
    assert worst["phase"] == "generation" and round(worst["peak_bytes"] / GB, 1) == 78.9
    t = first["terms_bytes"]
    resident = sum(v for k, v in t.items() if k in RESIDENT)
    assert (round(resident / GB, 1), round(t["vllm"] / GB, 1)) == (43.3, 35.6)
    assert round(t["activations"] / GB, 1) == 13.0

    cfg = ["experiment=llama3_70b_long", f"output_dir={tmp_path}"]
    cp2 = [*cfg, "+model.params.context_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"the engine of local rank 4 needs GPUs 4\.\.11"):
        plan(_compose(cp2), JobShape(8, 8, "test"))
    tp4 = plan(_compose([*cp2, "rollout.tensor_parallel_size=4"]), JobShape(8, 8, "test"))
    v4 = tp4["vllm"]
    assert (v4["engines"], v4["kv_tokens"], tp4["fits"]) == (8, 0, False)  # 2 per CP group
    assert round(v4["weights_bytes"] / GB, 1) == 35.3

    # the training side of CP 2, planned with the policy's own engine (the HF replica's terms
    # aside): stage 0's activations halve
    hf = [*cfg, "rollout=hf", "+model.params.context_parallel_size=2"]
    hf_cp2 = plan(_compose(hf), JobShape(8, 8, "test"))
    assert (hf_cp2["layout"]["dp"], hf_cp2["layout"]["cp"]) == (2, 2)
    cp2_first = next(x for x in hf_cp2["positions"] if (x["tp_rank"], x["pp_rank"]) == (1, 0))
    assert round(cp2_first["terms_bytes"]["activations"] / GB, 1) == 6.5
    # TP 4 x PP 2 x CP 2 x DP 4 keeps 4 copies but 8.8B parameters on a GPU: 68.9 GB resident,
    # with the engine's 35.6 GB over 80
    pp2 = plan(
        _compose([*hf, "model.params.pipeline_model_parallel_size=2"]), JobShape(8, 8, "test")
    )
    x = next(x for x in pp2["positions"] if (x["tp_rank"], x["pp_rank"]) == (1, 0))
    pp2_resident = sum(v for k, v in x["terms_bytes"].items() if k in RESIDENT)
    assert round(x["params"] / 1e9, 1) == 8.8 and round(pp2_resident / GB, 1) == 68.9
    assert round((pp2_resident + t["vllm"]) / GB, 1) == 104.5 > 80


def test_32k_recipe_fits_with_context_parallelism(tmp_path, monkeypatch, capsys):
    """experiment=llama3_70b_32k (rows of 32768 tokens, responses of 31744) fits 80 GB on 8 x 8
    GPUs at TP 8 x PP 2 x CP 2, with the numbers its comment gives: each row over two CP ranks
    (3.2 GB of activations on stage 0, 47.4 GB training peak; the long recipe's CP-1 layout
    would hold 13.0 and 58.9), eight TP-8 engines (two per CP rank's group, one per node, as
    at CP 1), generation peaking at 78.0 GB with 11 full-length sequences in the KV cache, 16
    prompts a step keeping the step model's generation at 501 s; on 16 nodes 71.4 GB and
    16 rollouts per engine in 2 waves."""
    rc, out, err = _run_in_process(
        ["experiment=llama3_70b_32k", "trainer.dry_run=true", f"output_dir={tmp_path}"],
        monkeypatch,
        capsys,
    )
    assert rc == 0, out + err
    assert "verdict: FITS in 80 GB per GPU: peak 78.0 GB at (TP 0, PP 1) in generation" in out
    assert "TP 8 x PP 2 x CP 2 x DP 2" in out
    report = json.loads((tmp_path / "dry_run.json").read_text())
    lay, w = report["layout"], report["workload"]
    assert (lay["tp"], lay["pp"], lay["cp"], lay["dp"], lay["world"]) == (8, 2, 2, 2, 64)
    assert (w["seq_len"], w["gen_len"], w["micro_batch_tokens"]) == (32768, 32768, 32768)
    assert report["fits"] and report["context_parallel_needed"] == []
    first = _busiest_stage0(report)
    assert round(first["terms_bytes"]["activations"] / GB, 1) == 3.2
    assert round(first["train_peak_bytes"] / GB, 1) == 47.4
    last = next(x for x in report["positions"] if x["pp_rank"] == 1)
    assert round(last["terms_bytes"]["logits"] / GB, 1) == 2.3
    v = report["vllm"]
    assert (v["max_model_len"], v["kv_tokens"], v["full_sequences"]) == (32768, 388052, 11)
    assert v["engines"] == 8 and v["rows_per_engine_step"] == 32
    sm = report["step_model"]["layouts"][0]
    assert (round(sm["generation_s"]), round(sm["training_s"]), round(sm["gpu_seconds"])) == (
        501,
        29,
        33961,
    )

    rc, out, err = _run_in_process(
        ["experiment=llama3_70b_32k", "trainer.dry_run=true", f"output_dir={tmp_path / 'n16'}"],
        monkeypatch,
        capsys,
        NNODES="16",
    )
    assert rc == 0, out + err
    wide = json.loads((tmp_path / "n16" / "dry_run.json").read_text())
    assert wide["vllm"]["engines"] == 16 and round(wide["worst"]["peak_bytes"] / GB, 1) == 71.4
    assert wide["vllm"]["rows_per_engine_step"] == 16  # 11 + 5: two waves, no longer halved
    assert round(wide["step_model"]["layouts"][0]["gpu_seconds"]) == 44658


def test_plan_counts_the_interleaved_schedules_extra_activations(tmp_path):
    from nemo_d3s.dry_run.sequence import interleaving_factor

    assert (
        interleaving_factor(4, 2) == 1.375
        and interleaving_factor(2, 1) == interleaving_factor(1, 4) == 1.0
    )
    base = _tiny_tp2pp2(tmp_path)
    report = plan(
        _compose([*base, "+model.params.virtual_pipeline_model_parallel_size=2"]),
        JobShape(1, 8, "test"),
    )
    # stage 0: 2 micro-batches in flight x 2 layers x 19840 bytes x (1 + 1 / 4)
    assert report["positions"][0]["terms_bytes"]["activations"] == int(1.25 * 2 * 2 * 19840)
    with pytest.raises(
        ConfigError, match="not divisible by pipeline_model_parallel_size x virtual"
    ):
        plan(
            _compose([*base, "+model.params.virtual_pipeline_model_parallel_size=3"]),
            JobShape(1, 8, "test"),
        )


# ----------------------------------------------------------------------------- MoE recipes


@pytest.mark.parametrize("name", sorted(MOE_RECIPES))
def test_moe_recipe_dry_runs_count_experts_and_give_a_verdict(name, tmp_path):
    """Total vs active parameters (the published 30.5B / 3.3B and 235B / 22B), experts
    counted over their EP x PP grid (the shards still sum to the model), megatron-core's
    meta build of the MoE stage agreeing with the table, the expert optimizer state and
    dispatcher buffers in the plan, and the verdict: Qwen3-30B-A3B fits one node of 141 GB
    GPUs and not of 80 GB ones; Qwen3-235B-A22B does not fit because one vLLM engine per
    model copy holds all the experts."""
    nodes, total, active, (tp, pp, dp, ep), fits = MOE_RECIPES[name]
    cfg = _compose([f"experiment={name}", f"output_dir={tmp_path}"])
    report = plan(cfg, JobShape(nodes, 8, "test"))
    print(render(report))
    moe = report["moe"]
    assert (report["total_params"], moe["total_params"], moe["active_params"]) == (
        total,
        total,
        active,
    )
    assert round(total / 1e9, 1) == {"qwen3_30b_a3b": 30.5, "qwen3_235b_a22b": 235.1}[name]
    lay = report["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"], moe["ep"], moe["etp"]) == (tp, pp, dp, ep, 1)
    assert moe["expert_dp"] == nodes * 8 // (ep * pp) == 1
    assert "counts" in report["checks"]["meta_build"]
    assert report["checks"]["shards_sum_params"] == total
    busiest = max(report["positions"], key=lambda x: x["expert_params"])
    # 128 experts of 3 H F' parameters per layer, E / EP per GPU, L / PP layers per stage
    spec = ModelSpec.from_folder(REPO / "nemo_d3s" / "recipes" / name)
    per_gpu = 128 // ep * 3 * spec.hidden_size * spec.moe_ffn_hidden_size * spec.num_layers // pp
    assert busiest["expert_params"] == moe["expert_params_per_gpu"] == per_gpu
    # fp32 main weights + 2 moments, 12 bytes, over expert DP (1 here: not sharded)
    assert moe["expert_optimizer_bytes_per_gpu"] == 12 * per_gpu
    assert 0 < moe["dispatch_buffer_bytes"] == busiest["terms_bytes"]["moe_dispatch"]
    assert report["fits"] is fits
    text = render(report)
    assert ("verdict: FITS" in text) is fits and f"EP {ep} x ETP 1" in text
    if not fits:
        assert any("does not hold its weights" in p for p in report["problems"])
        # whole experts over the engine's TP (128 divisible by it): the same bytes, still no room
        ep_engine = plan(
            _compose(
                [f"experiment={name}", f"output_dir={tmp_path}", "rollout.expert_parallel=true"]
            ),
            JobShape(nodes, 8, "test"),
        )
        assert ep_engine["vllm"]["weights_bytes"] == pytest.approx(
            report["vllm"]["weights_bytes"], rel=1e-12
        )
        assert not ep_engine["fits"]
    else:
        small = plan(
            _compose([f"experiment={name}", f"output_dir={tmp_path}", "trainer.gpu_memory_gb=80"]),
            JobShape(nodes, 8, "test"),
        )
        assert not small["fits"]


def test_moe_layouts_megatron_refuses_are_refused_by_the_dry_run(tmp_path):
    base = ["experiment=qwen3_30b_a3b", f"output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="num_experts=128 is not divisible by expert_model"):
        plan(_compose([*base, "model.params.expert_model_parallel_size=3"]), JobShape(3, 8, "t"))
    # Megatron's distributed optimizer is planned with experts: at EP 4 on 8 GPUs (expert DP
    # 2) it halves the expert optimizer state the plain AdamW keeps whole
    ep4 = [*base, "model.params.expert_model_parallel_size=4"]
    moe = {
        d: plan(_compose([*ep4, f"++model.params.distributed_optimizer={d}"]), JobShape(1, 8, "t"))[
            "moe"
        ]
        for d in ("true", "false")
    }
    assert moe["true"]["expert_optimizer_sharded_over"] == "expert DP"
    assert moe["false"]["expert_optimizer_sharded_over"] == "nothing"
    assert moe["true"]["expert_optimizer_bytes_per_gpu"] == pytest.approx(
        moe["false"]["expert_optimizer_bytes_per_gpu"] / 2, rel=1e-6
    )
    with pytest.raises(ConfigError, match="sequence_parallel=true"):
        plan(_compose([*base, "model.params.sequence_parallel=false"]), JobShape(1, 8, "t"))
    # what the backend refuses at start-up is refused by the plan: packed MoE rows, and EP 1
    # with ETP != TP under the distributed optimizer (experts reduced as dense weights)
    with pytest.raises(ConfigError, match="pack_sequences=true"):
        plan(_compose([*base, "trainer.pack_sequences=true"]), JobShape(1, 8, "t"))
    ep1 = [*base, "model.params.expert_model_parallel_size=1"]
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=1 != tensor_model"):
        plan(_compose(ep1), JobShape(1, 8, "t"))
    plan(_compose([*ep1, "++model.params.distributed_optimizer=false"]), JobShape(1, 8, "t"))
    # experts with context parallelism are planned (EP carved out of DP x CP; tested on gloo)
    cp = ["model.params.expert_model_parallel_size=2", "+model.params.context_parallel_size=2"]
    cp_plan = plan(_compose([*base, "rollout=hf", *cp]), JobShape(2, 8, "t"))
    layout, moe = cp_plan["layout"], cp_plan["moe"]
    assert (layout["tp"], layout["cp"], layout["dp"]) == (4, 2, 2)
    # its expert state is sharded over expert DP = 16 / (ETP 1 x EP 2 x PP 1) = 8, which holds
    # the CP ranks: 12 bytes / 8 a parameter (it was divided by CP once more)
    assert moe["expert_dp"] == 8
    assert moe["expert_optimizer_bytes_per_gpu"] == pytest.approx(
        12 * moe["expert_params_per_gpu"] / 8, rel=1e-9
    )


def test_expert_parallel_engines_for_a_dense_model_are_refused_naming_its_config(tmp_path):
    """The dry run's refusal is the engine build's line (``dense_model_refusal``), naming the
    model's config.json rather than "the model"."""
    overrides = ["experiment=llama3_8b", f"output_dir={tmp_path}", "rollout.expert_parallel=true"]
    folder = REPO / "nemo_d3s" / "recipes" / "llama3_8b"
    with pytest.raises(ConfigError) as e:
        plan(_compose(overrides), JobShape(1, 8, "test"))
    assert str(e.value).startswith(
        f"rollout.expert_parallel=true: {folder / 'config.json'} is not a mixture of experts"
    )


def test_dispatcher_buffers_count_the_expert_tp_gather():
    """Hand-worked: 2 rows x 8 tokens at TP 2 with sequence parallelism = T 8 tokens a rank, top-k
    2, hidden 4, bf16, full recompute (one layer). alltoall: the routed rows T k = 16 permuted and
    received over EP, then gathered over ETP 4 (the experts' input and output, 64 each):
    16 + 16 + 64 + 64 = 160 rows. allgather at EP 2: the tokens gathered over ETP x EP (64 rows)
    and their unpermuted sum (64), the local experts' input and output (ETP T k = 64 each): 256
    rows. Each row 4 x 2 bytes. At ETP 1 the all-to-all count is the old four copies of T k."""
    from dataclasses import replace
    from types import SimpleNamespace

    from nemo_d3s.dry_run.memory import Workload
    from nemo_d3s.dry_run.moe import dispatch_bytes

    spec = SimpleNamespace(num_experts=8, moe_topk=2, hidden_size=4, num_layers=6)
    w = Workload(
        seq_len=8,
        gen_len=8,
        micro_batch=2,
        logprob_micro_batch=2,
        micro_batches=1,
        rows_per_engine=1,
        recompute=True,
        dtype_bytes=2,
        chunk=8,
        sequence_parallel=True,
    )
    assert w.train_tokens * 0.5 == 8
    assert dispatch_bytes(spec, w, tp=2, pp=1, ep=2, etp=4) == 160 * 8
    assert dispatch_bytes(spec, w, tp=2, pp=1, ep=2, etp=4, dispatcher="allgather") == 256 * 8
    assert dispatch_bytes(spec, w, tp=2, pp=1, ep=2, etp=1) == 4 * 16 * 8
    no_recompute = replace(w, recompute=False)  # every layer of the stage: 6 layers over PP 2
    assert dispatch_bytes(spec, no_recompute, tp=2, pp=2, ep=2, etp=4) == 3 * 160 * 8
