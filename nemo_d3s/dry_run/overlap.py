"""Seconds and GPU-seconds of one step with the vLLM engines on the training GPUs or on
``rollout.generation_gpus`` GPUs apart, synchronous or with generation overlapped with the
update (``rollout.max_staleness`` >= 1: a step costs the longer phase, not their sum).

A floor model, to compare layouts, not to forecast: generation reads an engine GPU's weights
once per decode step at HBM bandwidth (``backends/vllm/memory.HBM_BYTES_PER_S``), times the
waves its KV cache needs for its rollouts; training does 2 N FLOPs per scored token (old
policy, and the reference with a KL term) and 6 N (8 N with full recompute) per trained token
at :data:`PEAK_FLOPS` over every training GPU, N the parameters, every kept rollout at full
length (the D3S / PODS share of kept rollouts averaged over the schedule; the token cut's
saving is left out). Refits and evaluation are left out too.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

from nemo_d3s.backends.vllm.memory import HBM_BYTES_PER_S

__all__ = ["PEAK_FLOPS", "kept_sample_share", "step_model"]

PEAK_FLOPS = 989e12  # an H100 SXM's dense bf16 datasheet figure (assumed, as HBM_BYTES_PER_S)


def kept_sample_share(cfg: Any) -> float:
    """The share of each step's rollouts the update trains on, averaged over the run (1 for
    GRPO; N / G for D3S and PODS along their schedule)."""
    from nemo_d3s.trainer.build import d3s_config

    d3s = d3s_config(cfg)
    if d3s.sample_rule == "all":
        return 1.0
    g = int(cfg.trainer.num_generations)
    grid = [i / 20 for i in range(21)]
    ns = [d3s.schedule.at(p)[0] for p in grid]
    return sum(min(1.0, n / g) if d3s.schedule.n_is_count else float(n) for n in ns) / len(ns)


def _generation_s(v: Dict[str, Any], engines: int, rows: int, decode_steps: int) -> float:
    """The decode floor of ``engines`` engines sharing ``rows`` rollouts."""
    per_engine = -(-rows // max(engines, 1))
    waves = math.ceil(per_engine / max(int(v["full_sequences"]), 1))
    return waves * decode_steps * float(v["weights_bytes"]) / HBM_BYTES_PER_S


def step_model(
    cfg: Any, *, world: int, dp: int, v: Dict[str, Any], params: int, seq_len: int, recompute: bool
) -> Dict[str, Any]:
    """The layouts' rows (``gpus``, ``generation_s``, ``training_s``, ``step_s``,
    ``gpu_seconds``): engines on the ``world`` training GPUs (one per model-parallel group,
    ``dp``: DP x CP), or
    with ``rollout.generation_gpus`` > 0 on those GPUs apart, synchronous and with k = 1.
    ``v``: the dry run's vLLM terms (one engine GPU's weights, KV capacity)."""
    t = cfg.trainer
    rows = int(t.prompts_per_step) * int(t.num_generations)
    share = kept_sample_share(cfg)
    per_token = 2 * (2 if float(cfg.algorithm.kl_coef) > 0 else 1) + (8 if recompute else 6)
    train_s = per_token * params * rows * share * seq_len / (world * PEAK_FLOPS)
    decode = int(t.max_new_tokens)
    apart = int(cfg.rollout.generation_gpus)
    layouts: List[Dict[str, Any]] = []
    if not apart:  # (an overlap on shared GPUs is not modelled: the phases share their compute)
        gen = _generation_s(v, dp, rows, decode)
        layouts.append(
            {
                "layout": "engines on the training GPUs, synchronous"
                + ("" if not int(cfg.rollout.max_staleness) else " (an overlap shares the GPUs)"),
                "gpus": world,
                "generation_s": gen,
                "step_s": gen + train_s,
            }
        )
    else:
        gen = _generation_s(v, apart // int(v["tensor_parallel_size"]), rows, decode)
        for k, step in ((0, gen + train_s), (1, max(gen, train_s))):
            what = "synchronous" if k == 0 else "k = 1 (overlapped)"
            layouts.append(
                {
                    "layout": f"engines on {apart} GPUs apart, {what}",
                    "gpus": world + apart,
                    "generation_s": gen,
                    "step_s": step,
                }
            )
    for x in layouts:
        x["training_s"] = train_s
        x["gpu_seconds"] = x["gpus"] * x["step_s"]
    return {"kept_sample_share": share, "layouts": layouts}
