"""The dry run's report: :func:`report` assembles the plan's parts, cross-checks and verdict into
a JSON-able dict; :func:`render` prints it (one row per stage and set of equal TP ranks, GB =
1e9 bytes).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from nemo_d3s.backends.megatron.param_counts import expert_real_param_count, meta_param_counts
from nemo_d3s.formats.weights import Layout
from nemo_d3s.backends.megatron.parallel import DEFAULT_ORDER
from nemo_d3s.dry_run.memory import (
    ASSUMPTIONS,
    GB,
    Workload,
    activation_bytes,
    megatron_lm_reference,
)
from nemo_d3s.dry_run.shape import Setup

__all__ = ["render", "report"]


def _cross_checks(s: Setup, positions: List[Dict[str, Any]]) -> Tuple[int, Dict[str, Any]]:
    """(the positions' real parameters, which must sum to the HF model's; megatron-core's
    meta-device build, whose counts must be the table's). RuntimeError when either fails."""
    shards_sum = sum(x["real_params"] for x in positions)
    if s.spec.num_experts:  # the experts, counted once over their EP x ETP x PP grid
        grid = Layout(tp=s.tp, pp=s.pp, padded_vocab=s.vocab, ep=s.ep, etp=s.etp)
        shards_sum += expert_real_param_count(s.spec, grid)
    if shards_sum != s.spec.num_params:
        raise RuntimeError(
            f"the per-position shards sum to {shards_sum} parameters, the model has "
            f"{s.spec.num_params}"
        )
    # (CP replicates each position's parameters: the world without it builds the same ones)
    meta = meta_param_counts(
        s.spec,
        tp=s.tp,
        pp=s.pp,
        world=s.shape.world // s.cp,
        padded_vocab=s.vocab,
        order=s.order,
        ep=s.ep,
        etp=s.etp,
    )
    for key, n in meta.get("counts", {}).items():
        t, p = (int(x) for x in key.split(","))
        want = next(x["params"] for x in positions if (x["tp_rank"], x["pp_rank"]) == (t, p))
        if n != want:
            raise RuntimeError(
                f"position (TP {t}, PP {p}): megatron-core builds {n} parameters, the weight table "
                f"says {want}"
            )
    return shards_sum, meta


def _verdict(
    s: Setup, positions: List[Dict[str, Any]], problems: List[str]
) -> Tuple[bool, Dict[str, Any]]:
    """(fits, the worst position); appends to ``problems`` why it does not fit: the training
    state alone (first: no micro-batch size fixes it) and the worst position's peak."""
    gpu = s.gpu
    worst = max(positions, key=lambda x: x["peak_bytes"])
    fits = all(x["fits"] for x in positions) and not problems
    state_keys = (
        "weights",
        "grads",
        "optimizer",
        "reference",
    )  # the training state, without rollouts
    heaviest = max(positions, key=lambda x: sum(x["terms_bytes"].get(k, 0) for k in state_keys))
    state = {k: heaviest["terms_bytes"][k] for k in state_keys if k in heaviest["terms_bytes"]}
    if sum(state.values()) > gpu:
        problems.insert(
            0,
            f"the training state alone needs {sum(state.values()) / GB:.1f} GB per GPU at (TP "
            f"{heaviest['tp_rank']}, PP {heaviest['pp_rank']}) ("
            + " + ".join(f"{k} {v / GB:.1f}" for k, v in state.items())
            + f") > trainer.gpu_memory_gb={gpu / GB:g}: shard the model over more GPUs "
            "(tensor/pipeline_model_parallel_size)",
        )
    needs_cp = [x["context_parallel_needed"] for x in positions if "context_parallel_needed" in x]
    if needs_cp:
        problems.append(needs_cp[0]["message"])
    if not all(x["fits"] for x in positions):
        problems.append(
            f"(TP {worst['tp_rank']}, PP {worst['pp_rank']}) needs "
            f"{worst['peak_bytes'] / GB:.1f} GB in {worst['peak_phase']} > "
            f"trainer.gpu_memory_gb={gpu / GB:g}; largest term: {worst['largest_term']} "
            f"({worst['terms_bytes'][worst['largest_term']] / GB:.1f} GB)"
        )
    return fits, worst


def _reference(s: Setup, w: Workload, positions: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Megatron-LM's theoretical memory beside this model's first stage."""
    ref = megatron_lm_reference(
        s.spec,
        padded_vocab=s.vocab,
        tp=s.tp,
        pp=s.pp,
        dp=s.dp,
        b=1,
        s=w.train_tokens,
        micro_batches=w.micro_batches,
        dtype_bytes=w.dtype_bytes,
        sequence_parallel=w.sequence_parallel,
    )
    first = max((x for x in positions if x["pp_rank"] == 0), key=lambda x: x["params"])
    no_recompute = Workload(**{**w.__dict__, "recompute": False})
    mine_act, _ = activation_bytes(s.spec, no_recompute, tp=s.tp, pp=s.pp, stage=0)
    return {
        **{k: int(v) for k, v in ref.items()},
        "this_model_first_stage_weight_grad_optimizer_bytes": sum(
            first["terms_bytes"][k] for k in ("weights", "grads", "optimizer")
        ),
        "this_model_first_stage_activation_bytes_no_recompute": int(mine_act),
        "note": (
            "the same 6 + 12/DP bytes per parameter; the shard differs only because "
            "Megatron-LM divides the TP-replicated norms by TP and leaves out q/k/v biases. "
            "Activations: s b h (10 + 24/t) per layer there vs s b (4 h + (2 d_h (a + g) + 3 "
            "F)/t) here (GQA, SwiGLU, no dropout masks), x 1.05 there, logits counted only at "
            "PP 1 there"
        ),
    }


def report(
    s: Setup,
    w: Workload,
    positions: List[Dict[str, Any]],
    vllm_terms: Dict[str, Any],
    problems: List[str],
    *,
    distributed_opt: bool,
) -> Dict[str, Any]:
    """The dry run's report (a JSON-able dict) of the plan's parts; appends to ``problems``
    why it does not fit; RuntimeError when a cross-check fails."""
    shards_sum, meta = _cross_checks(s, positions)
    fits, worst = _verdict(s, positions, problems)
    cfg, spec = s.cfg, s.spec
    return {
        "model": {
            "name": str(cfg.model.name),
            "folder": str(s.folder),
            "architecture": spec.architecture,
            "total_params": spec.num_params,
            "vocab_size": spec.vocab_size,
            "padded_vocab": s.vocab,
            "layers": spec.num_layers,
            "hidden": spec.hidden_size,
            "heads": spec.num_heads,
            "kv_heads": spec.kv_heads,
            "ffn": spec.ffn_hidden_size,
            "tie_word_embeddings": spec.tie_word_embeddings,
        },
        "total_params": spec.num_params,
        "fits": fits,
        "problems": problems,
        "gpu_memory_gb": s.gpu / GB,
        "assumptions": ASSUMPTIONS,
        "layout": {
            "nodes": s.shape.nodes,
            "gpus_per_node": s.shape.gpus_per_node,
            "world": s.shape.world,
            "world_from": s.shape.source,
            "tp": s.tp,
            "pp": s.pp,
            "dp": s.dp,
            "cp": s.cp,
            "rank_order": s.order,
            "optimizer": "distributed" if distributed_opt else "plain AdamW",
            "rollout_engine": s.engine,
            "vllm_tp": s.vllm_tp if s.engine == "vllm" else None,
            # engines on GPUs apart are not the model copies': their count is the GPUs'
            "rollout_engines_per_copy": 1 if s.generation_gpus else s.engines_per_copy,
            "rollout_generation_gpus": s.generation_gpus,
            "dtype_bytes": w.dtype_bytes,
            "prompts_per_dp_rank": int(cfg.trainer.prompts_per_step) // s.dp,
        },
        "workload": dict(w.__dict__),
        "positions": positions,
        "worst": {
            "tp_rank": worst["tp_rank"],
            "pp_rank": worst["pp_rank"],
            "peak_bytes": worst["peak_bytes"],
            "phase": worst["peak_phase"],
            "largest_term": worst["largest_term"],
        },
        "vllm": vllm_terms or None,
        "context_parallel_needed": [
            x["context_parallel_needed"] for x in positions if "context_parallel_needed" in x
        ],
        "checks": {
            "shards_sum_params": shards_sum,
            "meta_build": meta,
            "megatron_lm_reference": _reference(s, w, positions),
        },
    }


_COLUMNS = (
    "weights",
    "grads",
    "optimizer",
    "reference",
    "activations",
    "logits",
    "hf_replica",
    "hf_kv_cache",
    "cuda_context",
    "nccl",
    "nvls",
    "fragmentation",
    "moe_dispatch",
    "vllm",
    "vllm_asleep",
    "refit",
)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n:,}"


def render(report: Dict[str, Any]) -> str:
    """The per-GPU table (one row per pipeline stage and set of TP ranks with equal
    numbers; GB = 1e9 bytes) and the verdict."""
    lay, m = report["layout"], report["model"]
    cols = [c for c in _COLUMNS if any(c in x["terms_bytes"] for x in report["positions"])]
    order = lay.get("rank_order", DEFAULT_ORDER)
    order_text = "" if order == DEFAULT_ORDER else f" (ranks {order})"
    lines = [
        f"dry run: {m['architecture']} {_count(m['total_params'])} params ({m['folder']})",
        f"layout: {lay['nodes']} node(s) x {lay['gpus_per_node']} GPUs = {lay['world']} "
        f"({lay['world_from']}); TP {lay['tp']} x PP {lay['pp']}"
        + (f" x CP {lay['cp']}" if lay.get("cp", 1) > 1 else "")
        + f" x DP {lay['dp']}{order_text}; "
        f"rollout={lay['rollout_engine']}"
        + (f" (vLLM TP {lay['vllm_tp']})" if lay["vllm_tp"] else "")
        + (
            f", {lay['rollout_engines_per_copy']} engines per model copy"
            if lay.get("rollout_engines_per_copy", 1) > 1
            else ""
        )
        + (
            f", engines on {lay['rollout_generation_gpus']} GPUs apart"
            if lay.get("rollout_generation_gpus")
            else ""
        ),
    ]
    w = report["workload"]
    micro = (
        f"token budget {w['micro_batch_tokens']} (rows up to {w['seq_len']} tokens)"
        if w.get("micro_batch_tokens")
        else f"micro-batch {w['micro_batch']} x {w['seq_len']} tokens"
    )
    lines.append(
        f"workload: {micro}, {w['micro_batches']} micro-batches per DP rank, "
        f"recompute={'full' if w['recompute'] else 'off'}, sequence "
        f"parallel={'on' if w.get('sequence_parallel') else 'off'}, "
        f"{w['dtype_bytes']}-byte weights"
    )
    head = ["stage", "tp", "params"] + cols + ["train", "generate", "peak", "largest", "fits"]
    rows: List[List[str]] = []
    groups: Dict[Tuple, List[dict]] = {}
    for x in report["positions"]:
        key = (x["pp_rank"], x["params"], tuple(sorted(x["terms_bytes"].items())))
        groups.setdefault(key, []).append(x)
    for (p, _, _), xs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0]["tp_rank"])):
        x = xs[0]
        tps = [y["tp_rank"] for y in xs]
        tp_text = str(tps[0]) if len(tps) == 1 else f"{tps[0]}-{tps[-1]}"
        rows.append(
            [str(p), tp_text, _count(x["params"])]
            + [f"{x['terms_bytes'][c] / GB:.1f}" if c in x["terms_bytes"] else "-" for c in cols]
            + [
                f"{x['train_peak_bytes'] / GB:.1f}",
                f"{x['generation_peak_bytes'] / GB:.1f}",
                f"{x['peak_bytes'] / GB:.1f}",
                x["largest_term"],
                "yes" if x["fits"] else "NO",
            ]
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines.append("per GPU, GB:")
    for r in [head, *rows]:
        lines.append("  " + "  ".join(c.rjust(wd) for c, wd in zip(r, widths)))
    v = report["vllm"]
    if v:
        lines.append(
            f"vLLM: {v['engines']} engine(s) of TP {v['tensor_parallel_size']}, "
            f"{v['shards_per_gpu']} per busiest GPU; each GPU of an engine: "
            f"{v['reserved_bytes'] / GB:.1f} GB reserved = {v['weights_bytes'] / GB:.1f} "
            f"weights + {v['activation_bytes'] / GB:.1f} activations + "
            f"{v['kv_cache_bytes'] / GB:.1f} KV cache ({v['kv_tokens']} tokens, "
            f"{v['full_sequences']} sequences of {v['longest_rollout']}; "
            f"{v['rows_per_engine_step']} rollouts per engine per step)"
        )
        if v.get("gpus_idle_in_generation"):
            lines.append(
                f"vLLM: {v['gpus_idle_in_generation']} GPUs idle while generating "
                f"({v['idle_share_in_generation']:.0%}): {v['idle_why']}; idle GPU-seconds per "
                f"step = {v['gpus_idle_in_generation']} x the generation time, at least "
                f"{v['idle_gpu_seconds_per_step_min']:,.0f} "
                f"(decode floor {v['generation_floor_s']:.0f} s)"
            )
    sm = report.get("step_model")
    if sm:
        lines.append(
            "step, floor model (dry_run/overlap.py: decode at HBM bandwidth, training at peak "
            f"FLOP/s, kept rollouts {sm['kept_sample_share']:.0%} at full length):"
        )
        for x in sm["layouts"]:
            lines.append(
                f"  {x['layout']}: {x['gpus']} GPUs, generate {x['generation_s']:,.1f} s, "
                f"train {x['training_s']:,.1f} s, step {x['step_s']:,.1f} s = "
                f"{x['gpu_seconds']:,.0f} GPU-s"
            )
    meta = report["checks"]["meta_build"]
    if "counts" in meta:
        built = ", ".join("(TP {}, PP {})".format(*k.split(",")) for k in meta["built"])
        lines.append(
            f"checks: megatron-core built {built} on the meta device with the table's "
            f"parameter counts; shards sum to {report['checks']['shards_sum_params']:,} = "
            "the HF model's count"
        )
    else:
        lines.append(
            f"checks: meta-device build skipped ({meta['skipped']}); shards sum to "
            f"{report['checks']['shards_sum_params']:,} = the HF model's count"
        )
    moe = report.get("moe")
    if moe:
        lines.append(
            f"MoE: {moe['experts']} experts (top-{moe['topk']}), EP {moe['ep']} x ETP "
            f"{moe['etp']}, expert DP {moe['expert_dp']}, {moe['dispatcher']} dispatcher; "
            f"{_count(moe['total_params'])} total / {_count(moe['active_params'])} active "
            f"params; per GPU {_count(moe['expert_params_per_gpu'])} expert params, expert "
            f"optimizer state {moe['expert_optimizer_bytes_per_gpu'] / GB:.1f} GB, dispatcher "
            f"buffers {moe['dispatch_buffer_bytes'] / GB:.2f} GB"
        )
    wk = report["worst"]
    verdict = "FITS" if report["fits"] else "DOES NOT FIT"
    lines.append(
        f"verdict: {verdict} in {report['gpu_memory_gb']:g} GB per GPU: peak "
        f"{wk['peak_bytes'] / GB:.1f} GB at (TP {wk['tp_rank']}, PP {wk['pp_rank']}) in "
        f"{wk['phase']}, largest term {wk['largest_term']}"
    )
    for prob in report["problems"]:
        lines.append(f"  problem: {prob}")
    return "\n".join(lines)
