"""The dry run's plan: run config -> layout (``trainer.build.checked_backend_config``, so the
backend's refusals apply) -> each GPU's memory terms (``memory.py``) -> a verdict, as a
JSON-able dict. Cross-checks: each position's parameters from the weight table against
megatron-core's meta-device build (``param_counts.py``) and their sum against the HF model's;
Megatron-LM's theoretical memory reported beside.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from nemo_d3s.backends.megatron.param_counts import (
    local_param_count,
    real_param_count,
    stage_positions,
)
from nemo_d3s.backends.megatron.parallel import (
    DEFAULT_ORDER,
    engine_ranks_of_model_copies,
)
from nemo_d3s.backends.vllm.memory import (
    awake_engine_bytes,
    engine_params_per_gpu,
    engine_plan,
    engine_positions,
    engine_starts,
    generation_idle,
    refit_bytes,
    separate_plan,
    sleeping_engine_bytes,
)
from nemo_d3s.dry_run.memory import (
    GB,
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION_SHARE,
    GENERATION,
    RESIDENT,
    TRAINING,
    Workload,
    activation_bytes,
    kv_bytes_per_token,
    logits_bytes,
    minimal_training_bytes,
    nccl_bytes,
    nccl_communicators,
    node_ranks_of_groups,
    nvls_bytes,
    physical_gpu_bytes,
    vllm_activation_bytes,
)
from nemo_d3s.dry_run.moe import (
    activation_spec,
    dispatch_bytes,
    expert_dp,
    expert_params,
    moe_summary,
)
from nemo_d3s.dry_run.overlap import step_model
from nemo_d3s.dry_run.report import report
from nemo_d3s.dry_run.sequence import context_parallel_need, micro_batches_per_step
from nemo_d3s.dry_run.shape import JobShape, Setup, checked_setup, job_shape
from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.weights import Layout

__all__ = ["plan"]


# The plan is for CUDA, where "auto" is bfloat16 (MegatronBackend).
_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float32": 4}


def _workload(s: Setup) -> Workload:
    """What one training step asks of a GPU (``rollout_engines_per_copy`` engines per TP x PP
    group: DP x CP x that many, sharing the prompts)."""
    cfg, spec, mcfg, dp = s.cfg, s.spec, s.mcfg, s.dp
    engines = (
        s.generation_gpus // s.vllm_tp if s.generation_gpus else dp * s.cp * s.engines_per_copy
    )
    t = cfg.trainer
    ctx = int(spec.max_position_embeddings)
    vllm = str(cfg.rollout.engine) == "vllm"
    mml = cfg.rollout.max_model_len if vllm else None
    if mml is not None:
        if int(mml) > ctx:
            raise ConfigError(
                f"rollout.max_model_len={mml}: exceeds the model's context ({ctx} positions); "
                "vLLM refuses it"
            )
        ctx = int(mml)
    new = int(t.max_new_tokens)
    gen_new = max(new, int(t.eval_max_new_tokens or new))
    limit = cfg.task.max_prompt_tokens
    if limit is None:
        limit = ctx - gen_new
        if limit < 1:
            raise ConfigError(
                f"trainer.max_new_tokens={gen_new}: leaves no room for a prompt in the context of "
                f"{ctx} positions"
            )
    elif int(limit) + gen_new > ctx:
        where = "rollout.max_model_len" if mml is not None else "the model's context"
        raise ConfigError(
            f"task.max_prompt_tokens={limit} + {gen_new} new tokens = "
            f"{int(limit) + gen_new} exceeds {where} ({ctx}): the longest rollout would "
            "not fit"
        )
    rows = int(t.prompts_per_step) * int(t.num_generations)
    per_dp_update = -(-rows // (dp * int(t.num_mini_batches)))
    budget = int(t.micro_batch_tokens)
    lp_budget = (
        budget if t.logprob_micro_batch_tokens is None else int(t.logprob_micro_batch_tokens)
    )
    return Workload(
        seq_len=int(limit) + new,
        gen_len=int(limit) + gen_new,
        micro_batch=int(t.micro_batch_size),
        logprob_micro_batch=int(t.logprob_micro_batch_size),
        micro_batches=micro_batches_per_step(
            per_dp_update, int(limit) + new, int(t.micro_batch_size), budget
        ),
        rows_per_engine=-(-rows // engines),
        recompute=bool(mcfg.gradient_checkpointing),
        dtype_bytes=_DTYPE_BYTES[str(mcfg.dtype)],
        chunk=int(mcfg.entropy_chunk_size),
        sequence_parallel=bool(mcfg.sequence_parallel) and s.tp > 1,
        micro_batch_tokens=budget,
        logprob_micro_batch_tokens=lp_budget,
        vpp=int(mcfg.virtual_pipeline_model_parallel_size or 1),
        cp=s.cp,
    )


def _vllm_placement(
    shape: JobShape,
    *,
    tp: int,
    pp: int,
    dp: int,
    vllm_tp: int,
    order: str,
    cp: int = 1,
    engines_per_copy: int = 1,
) -> Dict[str, Any]:
    """The engines' GPUs as the runtime places them (``backends/vllm/placement.py``); ConfigError
    when two engines would share a GPU or one runs past its node.
    """
    try:
        return engine_plan(
            engine_ranks_of_model_copies(tp, pp, dp, order, cp, engines_per_copy),
            nodes=shape.nodes,
            gpus_per_node=shape.gpus_per_node,
            tensor_parallel_size=vllm_tp,
        )
    except ValueError as e:
        cps = f" x CP {cp}" if cp > 1 else ""
        per = f", {engines_per_copy} engines per copy" if engines_per_copy > 1 else ""
        raise ConfigError(f"{e} (TP {tp} x PP {pp}{cps} x DP {dp}, ranks {order}{per})") from None


# --------------------------------------------------------------------------- the parts of the plan
def _check_vllm_layout(s: Setup) -> Optional[Dict[str, Any]]:
    """The engines' placement (rollout.engine=vllm), after vLLM's own layout rules."""
    if s.engine != "vllm":
        return None
    if s.spec.num_heads % s.vllm_tp:
        raise ConfigError(
            f"rollout.tensor_parallel_size={s.vllm_tp}: does not divide num_attention_heads="
            f"{s.spec.num_heads} (vLLM shards the heads)"
        )
    if s.vllm_tp > s.shape.gpus_per_node:
        raise ConfigError(
            f"rollout.tensor_parallel_size={s.vllm_tp}: exceeds the "
            f"{s.shape.gpus_per_node} GPUs of a node (the in-process engine spans one node)"
        )
    if s.generation_gpus:  # engines on GPUs of their own: none on a training GPU
        return separate_plan(
            s.generation_gpus, gpus_per_node=s.shape.gpus_per_node, tensor_parallel_size=s.vllm_tp
        )
    return _vllm_placement(
        s.shape,
        tp=s.tp,
        pp=s.pp,
        dp=s.dp,
        vllm_tp=s.vllm_tp,
        order=s.order,
        cp=s.cp,
        engines_per_copy=s.engines_per_copy,
    )


def _vllm(s: Setup, w: Workload, placement: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """(one engine GPU's budget: weights, profiled activations, KV cache; the problems that
    stop vLLM from starting)."""
    cfg, spec, vllm_tp = s.cfg, s.spec, s.vllm_tp
    gpu = physical_gpu_bytes(cfg.trainer.gpu_memory_gb)  # vLLM's share is of the physical GPU
    gmu = float(cfg.rollout.gpu_memory_utilization)
    v_dtype = {"auto": w.dtype_bytes, "bfloat16": 2, "float16": 2, "float32": 4}[
        str(cfg.rollout.dtype)
    ]
    ep = bool(cfg.rollout.expert_parallel)
    weights = v_dtype * engine_params_per_gpu(spec, vllm_tp, ep, s.folder / "config.json")
    act = vllm_activation_bytes(activation_spec(spec), vllm_tp, v_dtype)
    kv = gmu * gpu - weights - act
    per_tok = kv_bytes_per_token(spec, vllm_tp, v_dtype)
    tokens = max(0, int(kv // per_tok))
    terms = {
        "utilization": gmu,
        "tensor_parallel_size": vllm_tp,
        "physical_gpu_bytes": gpu,
        "reserved_bytes": gmu * gpu,
        "weights_bytes": weights,
        "activation_bytes": act,
        "kv_cache_bytes": kv,
        "kv_bytes_per_token": per_tok,
        "kv_tokens": tokens,
        "max_model_len": int(cfg.rollout.max_model_len or spec.max_position_embeddings),
        "longest_rollout": w.gen_len,
        "full_sequences": tokens // w.gen_len,
        "rows_per_engine_step": w.rows_per_engine,
        # generating while the policy trains (max_staleness > 0), the engine never sleeps
        "sleep": bool(cfg.rollout.sleep) and not int(cfg.rollout.max_staleness),
        **placement,
    }
    graphs = cfg.rollout.enforce_eager is not True  # null: CUDA graphs on a GPU
    largest = v_dtype * spec.hidden_size * max(spec.vocab_size, spec.ffn_hidden_size)
    nvls = nvls_bytes({"tp": vllm_tp}) if s.nvls else 0  # the engine's TP group, one node
    terms.update(
        cuda_graphs=graphs,
        awake_bytes=awake_engine_bytes(gmu * gpu, vllm_tp, nvls_bytes=nvls),
        asleep_bytes=sleeping_engine_bytes(vllm_tp, cuda_graphs=graphs, nvls_bytes=nvls),
        refit_bytes=refit_bytes(
            engine_weight_bytes=weights,
            tp=s.tp,
            largest_tensor_bytes=largest,
            bucket_bytes=int(float(cfg.rollout.refit_bucket_mb) * 2**20),
        ),
        engine_positions=[]
        if s.generation_gpus
        else [
            list(x)
            for x in engine_positions(
                s.tp,
                s.pp,
                vllm_tp,
                # Megatron's orders: tp-cp-ep-pp-dp (stages TP x CP apart), tp-cp-ep-dp-pp
                stage_stride_ranks=s.tp * s.cp * (1 if s.order != DEFAULT_ORDER else s.dp),
                engines_per_copy=s.engines_per_copy,
            )
        ],
    )
    terms.update(
        {}
        if s.generation_gpus  # the step model says what the training GPUs wait for
        else generation_idle(
            gpus_total=s.shape.nodes * s.shape.gpus_per_node,
            gpus_with_engine=int(placement["gpus_with_engine"]),
            copy_gpus=s.tp * s.pp,
            vllm_tp=vllm_tp,
            weight_bytes_per_gpu=weights,
            decode_steps=int(cfg.trainer.max_new_tokens),
            cp=s.cp,
            engines_per_copy=s.engines_per_copy,
        )
    )
    problems: List[str] = []
    if terms["kv_cache_bytes"] <= 0:
        problems.append(
            f"vLLM: rollout.gpu_memory_utilization={terms['utilization']} x {gpu / GB:g} GB "
            f"does not hold its weights ({terms['weights_bytes'] / GB:.1f} GB at vLLM TP "
            f"{vllm_tp}) and activations: no KV cache"
        )
    elif terms["kv_tokens"] < terms["max_model_len"]:
        problems.append(
            f"vLLM: a KV cache of {terms['kv_tokens']} tokens cannot hold one sequence of "
            f"max_model_len={terms['max_model_len']} (vLLM refuses to start; set "
            "rollout.max_model_len to the longest rollout)"
        )
    if s.generation_gpus and terms["awake_bytes"] > s.gpu:  # an engine GPU apart holds it alone
        problems.append(
            f"vLLM: an engine GPU apart needs {terms['awake_bytes'] / GB:.1f} GB awake "
            f"(rollout.gpu_memory_utilization={gmu} + context + TP communicator) > "
            f"trainer.gpu_memory_gb={s.gpu / GB:g}"
        )
    return terms, problems


def _optimizer_bytes(s: Setup, w: Workload) -> Tuple[bool, float, float]:
    """(distributed optimizer?, gradient bytes per parameter, optimizer bytes per parameter)."""
    d = w.dtype_bytes
    # The plan is for CUDA, where distributed_optimizer=null means Megatron's.
    if (
        s.mcfg.distributed_optimizer is not False
    ):  # fp32 grads; fp32 main weights (unless fp32 already) + 2 moments over DP
        return True, 4, (12 if d < 4 else 8) / (s.dp * s.cp)  # sharded over DP x CP
    # plain AdamW over each rank's shards: fp32 grads (MainWeightsAdamW accumulates a bf16
    # gradient into an fp32 main_grad; the DP average sums them in buckets of
    # optimizer.AVERAGE_BUCKET_BYTES); fp32 main weights (unless fp32 already) + 2 fp32
    # moments, not sharded over DP
    return False, 4, (12 if d < 4 else 8)


def _position(s: Setup, w: Workload, t: int, p: int, vllm_terms: Dict[str, Any]) -> Dict[str, Any]:
    """The memory terms, peaks and verdict of the GPU at (TP rank t, PP stage p)."""
    spec, d = s.spec, w.dtype_bytes
    distributed, grad_per_param, opt_per_param = _optimizer_bytes(s, w)
    layout = Layout(tp=s.tp, pp=s.pp, tp_rank=t, pp_rank=p, padded_vocab=s.vocab, te=False)
    layout = replace(layout, ep=s.ep, etp=s.etp)  # (every EP / ETP rank holds as many)
    n, n_expert = local_param_count(spec, layout), expert_params(s, layout)
    # the distributed optimizer shards expert state over the expert-DP group (world / (ETP x
    # EP x PP), CP ranks included), not DP x CP
    expert_opt = opt_per_param * n_expert * (s.dp * s.cp / expert_dp(s) if distributed else 1)
    terms: Dict[str, float] = {
        "weights": d * n,
        "grads": grad_per_param * n,
        "optimizer": opt_per_param * (n - n_expert) + expert_opt,
    }
    if float(s.cfg.algorithm.kl_coef) > 0:
        terms["reference"] = d * n
    if s.engine == "hf" and (t, p) in engine_starts(s.tp, s.pp, s.engines_per_copy):
        terms["hf_replica"] = d * spec.num_params
    act, in_flight = activation_bytes(activation_spec(spec), w, tp=s.tp, pp=s.pp, stage=p)
    terms["activations"] = act
    if spec.num_experts:
        terms["moe_dispatch"] = dispatch_bytes(
            spec,
            w,
            tp=s.tp,
            pp=s.pp,
            ep=s.ep,
            etp=s.etp,
            dispatcher=str(s.mcfg.moe_token_dispatcher_type),
        )
    logit_note = None
    if p == s.pp - 1:
        terms["logits"], logit_note = logits_bytes(s.vocab, w, tp=s.tp)
    if "hf_replica" in terms:
        rows = (
            w.rows_per_engine
            if s.mcfg.generation_batch_size is None
            else min(w.rows_per_engine, int(s.mcfg.generation_batch_size))
        )
        terms["hf_kv_cache"] = rows * w.gen_len * kv_bytes_per_token(spec, 1, d)
    on_engine_gpu = s.engine == "vllm" and [t, p] in vllm_terms["engine_positions"]
    if on_engine_gpu:  # this GPU carries an engine worker (backends/vllm/memory.py)
        rb = vllm_terms["refit_bytes"]
        terms["vllm"] = vllm_terms["awake_bytes"]
        terms["vllm_asleep"] = vllm_terms["asleep_bytes" if vllm_terms["sleep"] else "awake_bytes"]
        terms["refit"] = sum(rb.values()) - rb["engine_weights"]
    terms["cuda_context"] = CUDA_CONTEXT_BYTES
    terms["nccl"] = nccl_bytes(
        tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, tied_embeddings=bool(spec.tie_word_embeddings)
    )
    if s.nvls:
        used = nccl_communicators(
            tp=s.tp, pp=s.pp, dp=s.dp, cp=s.cp, tied_embeddings=bool(spec.tie_word_embeddings)
        )
        tc = s.tp * s.cp  # Megatron's orders tp-cp-dp-pp and tp-cp-pp-dp
        node = node_ranks_of_groups(
            tp=s.tp,
            pp=s.pp,
            dp=s.dp,
            cp=s.cp,
            dp_stride=tc if s.order == DEFAULT_ORDER else tc * s.pp,
            pp_stride=tc * s.dp if s.order == DEFAULT_ORDER else tc,
            gpus_per_node=s.shape.gpus_per_node,
        )
        terms["nvls"] = nvls_bytes({k: v for k, v in node.items() if k in used})
    terms["fragmentation"] = FRAGMENTATION_SHARE * (act + terms.get("logits", 0.0))
    resident = sum(v for k, v in terms.items() if k in RESIDENT)
    # the trainer empties its CUDA cache before the engine wakes: generation sees the resident state
    # only
    train_peak = (
        resident + sum(v for k, v in terms.items() if k in TRAINING) + terms.get("vllm_asleep", 0)
    )
    gen_peak = resident + sum(v for k, v in terms.items() if k in GENERATION)
    refit_peak = (
        resident + terms["vllm_asleep"] + terms["refit"] + rb["engine_weights"]
        if on_engine_gpu
        else 0.0
    )
    peak = max(train_peak, gen_peak, refit_peak)
    counted = {k: v for k, v in terms.items() if k not in ("cuda_context", "nccl", "nvls")}
    cp_need = context_parallel_need(
        resident,
        minimal_training_bytes(activation_spec(spec), w, s.vocab, tp=s.tp, pp=s.pp, stage=p),
        s.gpu,
        seq_len=w.seq_len,
        position=f"(TP {t}, PP {p})",
    )
    return {
        "tp_rank": t,
        "pp_rank": p,
        "params": n,
        "real_params": real_param_count(spec, layout),
        "expert_params": n_expert,
        "expert_optimizer_bytes": int(expert_opt),
        "layers": spec.num_layers // s.pp,
        "in_flight_micro_batches": in_flight,
        "terms_bytes": {k: int(v) for k, v in terms.items()},
        "train_peak_bytes": int(train_peak),
        "generation_peak_bytes": int(gen_peak),
        "refit_peak_bytes": int(refit_peak),
        "peak_bytes": int(peak),
        # what generation would need if the trainer kept its cached blocks (not what runs)
        **(
            {
                "generation_peak_if_cache_kept_bytes": int(
                    train_peak - terms["vllm_asleep"] + terms["vllm"]
                )
            }
            if on_engine_gpu
            else {}
        ),
        "peak_phase": "training"
        if peak == train_peak
        else "generation"
        if peak == gen_peak
        else "refit",
        "largest_term": max(counted, key=lambda k: counted[k]),
        "fits": peak <= s.gpu,
        **({"logits_from": logit_note} if logit_note else {}),
        **({"context_parallel_needed": cp_need} if cp_need else {}),
    }


# ----------------------------------------------------------------------------- the plan
def plan(cfg: Any, shape: Optional[JobShape] = None) -> Dict[str, Any]:
    """The dry run's report (a JSON-able dict); ConfigError when the layout cannot run."""
    s = checked_setup(
        cfg, shape or job_shape(nodes=cfg.trainer.nodes, gpus_per_node=cfg.trainer.gpus_per_node)
    )
    placement = _check_vllm_layout(s)
    w = _workload(s)
    vllm_terms, problems = _vllm(s, w, placement) if placement is not None else ({}, [])
    positions = [_position(s, w, t, p, vllm_terms) for t, p in stage_positions(s.tp, s.pp)]
    distributed_opt, _, _ = _optimizer_bytes(s, w)
    out = report(s, w, positions, vllm_terms, problems, distributed_opt=distributed_opt)
    if s.spec.num_experts:
        out["moe"] = moe_summary(s, positions, distributed_opt)
    if vllm_terms:
        out["step_model"] = step_model(
            s.cfg,
            world=s.shape.world,
            dp=s.dp * s.cp * s.engines_per_copy,  # the engines: E per TP x PP group
            v=vllm_terms,
            params=s.spec.num_params,
            seq_len=w.seq_len,
            recompute=w.recompute,
        )
    return out
