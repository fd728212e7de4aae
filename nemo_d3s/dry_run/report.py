"""The dry run's report as text: one row per pipeline stage and set of TP ranks with equal
numbers (GB = 1e9 bytes), the vLLM engines, the cross-checks and the verdict."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from nemo_d3s.backends.megatron.parallel import DEFAULT_ORDER
from nemo_d3s.dry_run.memory import GB

__all__ = ["render"]

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
    "fragmentation",
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
    lines = [
        f"dry run: {m['architecture']} {_count(m['total_params'])} params ({m['folder']})",
        f"layout: {lay['nodes']} node(s) x {lay['gpus_per_node']} GPUs = {lay['world']} ({lay['world_from']}); "
        f"TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']}"
        f"{'' if lay.get('rank_order', DEFAULT_ORDER) == DEFAULT_ORDER else ' (ranks ' + lay['rank_order'] + ')'}"
        f"; rollout={lay['rollout_engine']}"
        + (f" (vLLM TP {lay['vllm_tp']})" if lay["vllm_tp"] else ""),
    ]
    w = report["workload"]
    micro = (
        f"token budget {w['micro_batch_tokens']} (rows up to {w['seq_len']} tokens)"
        if w.get("micro_batch_tokens")
        else f"micro-batch {w['micro_batch']} x {w['seq_len']} tokens"
    )
    lines.append(
        f"workload: {micro}, {w['micro_batches']} "
        f"micro-batches per DP rank, recompute={'full' if w['recompute'] else 'off'}, "
        f"sequence parallel={'on' if w.get('sequence_parallel') else 'off'}, {w['dtype_bytes']}-byte weights"
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
            f"vLLM: {v['engines']} engine(s) of TP {v['tensor_parallel_size']}, {v['shards_per_gpu']} per "
            f"busiest GPU; each GPU of an engine: {v['reserved_bytes'] / GB:.1f} GB reserved = "
            f"{v['weights_bytes'] / GB:.1f} weights + {v['activation_bytes'] / GB:.1f} activations + "
            f"{v['kv_cache_bytes'] / GB:.1f} KV cache ({v['kv_tokens']} tokens, {v['full_sequences']} "
            f"sequences of {v['longest_rollout']}; {v['rows_per_engine_step']} rollouts per engine per step)"
        )
    meta = report["checks"]["meta_build"]
    if "counts" in meta:
        built = ", ".join("(TP {}, PP {})".format(*k.split(",")) for k in meta["built"])
        lines.append(
            f"checks: megatron-core built {built} on the meta device with the "
            f"table's parameter counts; shards sum to {report['checks']['shards_sum_params']:,} = the HF "
            "model's count"
        )
    else:
        lines.append(
            f"checks: meta-device build skipped ({meta['skipped']}); shards sum to "
            f"{report['checks']['shards_sum_params']:,} = the HF model's count"
        )
    wk = report["worst"]
    verdict = "FITS" if report["fits"] else "DOES NOT FIT"
    lines.append(
        f"verdict: {verdict} in {report['gpu_memory_gb']:g} GB per GPU: peak {wk['peak_bytes'] / GB:.1f} GB at "
        f"(TP {wk['tp_rank']}, PP {wk['pp_rank']}) in {wk['phase']}, largest term {wk['largest_term']}"
    )
    for prob in report["problems"]:
        lines.append(f"  problem: {prob}")
    return "\n".join(lines)
