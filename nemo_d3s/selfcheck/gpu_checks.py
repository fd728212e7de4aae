"""CUDA-only checks on the trainer's RL run (``rl.megatron_step``) or vLLM. ``gpu.vllm``: the
run with ``rollout=vllm``; passes when both steps trained and the post-refit
``rollout_logprob_mismatch_abs`` is within 0.05 nats. ``gpu.peak_memory``: the reserved peak
over the dry run's prediction, fails above 1 (also the allocated peak and the unused share).
``gpu.step_time``: the last step time, passes when finite.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Dict

from nemo_d3s.selfcheck.base import Check, Context, within
from nemo_d3s.selfcheck.report import CheckFailed, NotRun
from nemo_d3s.selfcheck.rl_checks import run_rl

__all__ = ["CHECKS"]

MISMATCH_BOUND = 0.05


def _rl(ctx: Context) -> Dict[str, Any]:
    res = ctx.cache.get("rl")
    if res is None:
        raise NotRun("rl.megatron_step did not complete")
    return res


def check_vllm(ctx: Context) -> Dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise NotRun("vLLM not installed (pip install 'nemo_d3s[vllm]' or slurm/Dockerfile)")
    res = run_rl(ctx, "rl_vllm", extra=["rollout=vllm", "rollout.gpu_memory_utilization=0.3"])
    last = res["last"]
    out: Dict[str, Any] = {"steps": res["rows"], "optimizer_steps": last.get("optimizer_steps")}
    for k in ("rollout_logprob_mismatch_kl", "rollout_logprob_mismatch_max_ratio", "time_step"):
        if k in last:
            out[k] = last[k]
    if res["rows"] < 2 or not last.get("optimizer_steps", 0) > 1:
        raise CheckFailed(
            "the vLLM run did not take two optimizer steps (a refit between them)", out
        )
    if "rollout_logprob_mismatch_abs" not in last:
        raise CheckFailed(
            "the run reported no rollout_logprob_mismatch_abs (engine log-probs missing)", out
        )
    within("logprob_mismatch_abs", float(last["rollout_logprob_mismatch_abs"]), MISMATCH_BOUND, out)
    return out


def check_peak_memory(ctx: Context) -> Dict[str, Any]:
    from nemo_d3s.dry_run import JobShape, plan

    res = _rl(ctx)
    report = plan(res["cfg"], JobShape(1, ctx.world, f"self-check world {ctx.world}"))
    predicted = float(report["worst"]["peak_bytes"])
    measured = float(res["peak_reserved_bytes"])
    out: Dict[str, Any] = {
        "measured_gib": measured / 2**30,
        "predicted_gib": predicted / 2**30,
        "predicted_phase": report["worst"]["phase"],
    }
    if res.get("peak_allocated_bytes"):
        out["allocated_gib"] = float(res["peak_allocated_bytes"]) / 2**30
        out["unused_reserved_share"] = 1.0 - float(res["peak_allocated_bytes"]) / measured
    within("ratio", measured / predicted, 1.0, out)
    return out


def check_step_time(ctx: Context) -> Dict[str, Any]:
    last = _rl(ctx)["last"]
    t = float(last.get("time_step", float("nan")))
    out = {
        "time_step_s": t,
        **{k: v for k, v in last.items() if k.startswith("time_") and k != "time_step"},
    }
    if not math.isfinite(t) or t <= 0:
        raise CheckFailed("no step time recorded", out)
    return out


CHECKS = [
    Check("gpu.vllm", True, check_vllm),
    Check("gpu.peak_memory", True, check_peak_memory),
    Check("gpu.step_time", True, check_step_time),
]
