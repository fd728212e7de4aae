"""Per-step metrics, global over all data-parallel ranks, for what the selector's own metrics
do not cover: rollout and update token counts, the policy's loss sums. Each function makes at
most one small all-reduce.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from nemo_d3s.backends.base import Rollouts
from nemo_d3s.core.losses import finalize_metrics
from nemo_d3s.core.off_policy import ImportanceWeights
from nemo_d3s.core.routing import routing_mismatch_counts
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.distributed.quantiles import global_quantiles
from nemo_d3s.tasks.base import REWARD_FAILURES

__all__ = [
    "budget_metrics",
    "mismatch_metrics",
    "padding_metrics",
    "rollout_metrics",
    "selection_metrics",
    "token_metrics",
    "importance_metrics",
    "update_metrics",
]


def rollout_metrics(
    groups: ParallelGroups, stage: Any, ro: Rollouts, failures: Dict[str, int]
) -> Dict[str, float]:
    """Rewards and group counts from the SampleStage (whole batch); lengths and failed reward
    calls (``failures``: by reason) summed over ranks; a reason's count only when not 0."""
    s = stage.metrics
    by_reason = {f"reward_failed_{r}": float(failures.get(r, 0)) for r in REWARD_FAILURES}
    t = groups.sum(
        {
            "rollout_tokens": float(ro.batch.response_mask.sum()),
            "finished": float(ro.finished.sum()),
            "reward_errors": float(sum(failures.values())),
            **by_reason,
        }
    )
    n = s["n_samples"]
    return {
        "n_prompts": s["n_groups"],
        "n_samples": n,
        "reward_mean": s["reward_mean"],
        "reward_std": s["reward_std"],
        "reward_max": s["reward_max"],
        "n_degenerate_groups": s["n_degenerate_groups"],
        "n_informative_groups": s["n_informative_groups"],
        "response_len_mean": t["rollout_tokens"] / max(n, 1.0),
        "finished_frac": t["finished"] / max(n, 1.0),
        "rollout_tokens": t["rollout_tokens"],
        "reward_errors": t["reward_errors"],
        **{k: t[k] for k in by_reason if t[k]},
    }


def selection_metrics(stage: Any) -> Dict[str, float]:
    """How many rollouts survived and how spread their advantages are (no collective)."""
    keys = (
        "n_kept_samples",
        "kept_sample_ratio",
        "kept_adv_var",
        "adv_var_all",
        "kept_adv_abs_mean",
        "share_nonzero_adv",
        "n_keep",
    )
    return {k: float(stage.metrics[k]) for k in keys}


def token_metrics(groups: ParallelGroups, tok: Any, kept: Any, scored: bool) -> Dict[str, float]:
    """From a TokenStage (whole-batch metrics) and the kept samples' TokenBatch; ``scored``:
    whether the old-log-prob/entropy pass ran over them (its cost is ``logprob_tokens``)."""
    m = tok.metrics
    out = {
        "logprob_tokens": groups.sum({"n": float(kept.attention_mask.sum()) if scored else 0.0})[
            "n"
        ],
        "k_frac": float(tok.k_frac),
        "n_eligible_tokens": m["n_eligible_tokens"],
        "n_kept_tokens": m["n_kept_tokens"],
        "kept_token_ratio": m["kept_token_ratio"],
        "samples_without_tokens": m["samples_without_tokens"],
    }
    for k in ("mean_entropy_kept", "mean_entropy_eligible", "k_frac_schedule"):
        if k in m:
            out[k] = m[k]
    return out


def update_metrics(groups: ParallelGroups, upd: Any, report: Dict[str, float]) -> Dict[str, float]:
    """From the UpdateBatch and ``update_policy``'s report (rank-local sums)."""
    steps = max(report.get("optimizer_steps", 0.0), 1.0)
    # Loss-side sums add across ranks; grad_norm/lr/imbalance are identical on every rank.
    same_everywhere = {
        "optimizer_steps",
        "skipped_nonfinite",
        "grad_norm",
        "lr",
        "dp_imbalance_before",
        "dp_imbalance_after",
    }
    local = {k: v for k, v in report.items() if k not in same_everywhere}
    local["update_rows"] = float(len(upd))
    t = groups.sum(
        local, keys_may_differ=True
    )  # a rank that trained on no rows has no loss metrics
    out = {
        # the papers' count: response tokens that carry loss; and the compute: every token
        # the update's forward/backward attended (prompts and the kept rows' prefixes too)
        "update_tokens": t.pop("update_tokens_local"),
        "update_compute_tokens": t.pop("update_compute_tokens_local"),
        "update_rows": t.pop("update_rows"),
        "optimizer_steps": report.get("optimizer_steps", 0.0),
        "grad_norm": report.get("grad_norm", 0.0) / steps,
        "lr": report.get("lr", 0.0),
    }
    if report.get("skipped_nonfinite"):  # only when some were: the usual row keeps its keys
        out["skipped_nonfinite"] = report["skipped_nonfinite"]
    for k in ("dp_imbalance_before", "dp_imbalance_after"):
        if k in report:
            out[k] = report[k]
    # loss / pg_loss / kl_loss (already divided by the global denominator) and the router
    # losses (moe_*) are per-optimizer-step values; report their mean over the step's
    # mini-batches.
    for key in [k for k in t if k in ("loss", "pg_loss", "kl_loss") or k.startswith("moe_")]:
        t[key] = t[key] / steps
    if "fed_tokens" in t:
        out.update(_padding_share("update", t.pop("fed_tokens"), t.pop("attended_tokens", 0.0)))
    out.update(finalize_metrics(t))
    return out


def _padding_share(prefix: str, fed: float, attended: float) -> Dict[str, float]:
    return {
        f"{prefix}_fed_tokens": fed,
        f"{prefix}_padding_share": 1.0 - attended / fed if fed > 0 else 0.0,
    }


def padding_metrics(
    groups: ParallelGroups, prefix: str, stats: Dict[str, float]
) -> Dict[str, float]:
    """``<prefix>_fed_tokens`` and ``<prefix>_padding_share`` (1 - attended / fed) from the
    policies' ``Scores.stats``; {} when no rank counts them. One all-reduce, on every rank.
    """
    t = groups.sum(
        {
            "fed": float(stats.get("fed_tokens", 0.0)),
            "attended": float(stats.get("attended_tokens", 0.0)),
            "counted": float("fed_tokens" in stats),
        }
    )
    if t["counted"] == 0:
        return {}
    return _padding_share(prefix, t["fed"], t["attended"])


def mismatch_metrics(
    groups: ParallelGroups,
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
) -> Dict[str, float]:
    """Engine vs trainer numerics on the response tokens of the whole DP batch.

    Inputs [B_kept, S]; d = old - sampling log-prob: ``rollout_logprob_mismatch_kl`` = mean
    exp(d) - d - 1 (unbiased KL(pi_engine || pi_train)), ``..._abs`` = mean |d|,
    ``..._max_ratio`` = max exp(d).
    """
    d = (old_logprobs - sampling_logprobs).to(torch.float64)[response_mask]
    t = groups.sum(
        {
            "kl": float((torch.exp(d) - d - 1).sum()),
            "abs": float(d.abs().sum()),
            "n": float(d.numel()),
        }
    )
    top = groups.max(float(d.max()) if d.numel() else float("-inf"))
    n = max(t["n"], 1.0)
    return {
        "rollout_logprob_mismatch_kl": t["kl"] / n,
        "rollout_logprob_mismatch_abs": t["abs"] / n,
        "rollout_logprob_mismatch_max_ratio": float(torch.exp(torch.tensor(top)))
        if t["n"]
        else 1.0,
    }


def routing_metrics(
    groups: ParallelGroups,
    engine_experts: torch.Tensor,
    trainer_experts: torch.Tensor,
    response_mask: torch.Tensor,
) -> Dict[str, float]:
    """Engine vs trainer routing of a mixture of experts on the response tokens of the whole DP
    batch (``core.routing``): ``rollout_routing_mismatch`` = the share of the response tokens
    both routed (the engine feeds back every sampled token but the last) whose set of experts
    differs in some layer. Inputs [B_kept, S, L, K] and [B_kept, S]."""
    differ, total = routing_mismatch_counts(engine_experts, trainer_experts, response_mask)
    t = groups.sum({"differ": float(differ), "total": float(total)})
    return {"rollout_routing_mismatch": t["differ"] / max(t["total"], 1.0)}


# (name, q) of the importance ratio's quantiles in the step's metrics
IS_QUANTILES = (("min", 0.0), ("p01", 0.01), ("p50", 0.5), ("p99", 0.99), ("max", 1.0))


def importance_metrics(
    groups: ParallelGroups,
    iw: ImportanceWeights,
    response_mask: torch.Tensor,
    token_keep: torch.Tensor,
    cap: Optional[float],
    mode: str,
) -> Dict[str, float]:
    """``is_ratio_<q>``: quantiles of the importance ratio (core/off_policy.py, at its level)
    over the kept samples' response tokens [B_kept, S], exact over DP; with a correction
    (``cap``) the share of the selected tokens (``token_keep``) it truncated
    (``is_truncated_share``) or dropped (``is_masked_share``). Collectives: 4 small
    all-reduces for the quantiles, one for the shares."""
    log_r = iw.log_ratio[response_mask]
    values = global_quantiles(log_r, [q for _, q in IS_QUANTILES], groups.dp, groups.device)
    out = {}
    if not math.isnan(values[0]):
        out = {f"is_ratio_{n}": math.exp(v) for (n, _), v in zip(IS_QUANTILES, values)}
    if cap is not None:
        if mode == "mask":
            hit = token_keep & ~iw.keep
        else:
            hit = token_keep & (iw.log_ratio > math.log(float(cap)))
        t = groups.sum({"hit": float(hit.sum()), "n": float(token_keep.sum())})
        name = "is_masked_share" if mode == "mask" else "is_truncated_share"
        out[name] = t["hit"] / max(t["n"], 1.0)
    return out


def budget_metrics(m: Dict[str, float]) -> Dict[str, float]:
    """Where a step's time went, from its metrics ``m``: ``time_generation``, the engine's
    seconds on the step's rollouts (inside the step when synchronous, beside earlier steps
    otherwise), and ``time_training``, the update budget's seconds (old-policy and reference
    scoring, the update). With ``n_samples`` generated and ``n_kept_samples`` trained, the
    PODS regime's two budgets."""
    train = sum(float(m.get(k, 0.0)) for k in ("time_logprob", "time_reference", "time_update"))
    return {
        "time_generation": float(m.get("time_generation", m.get("time_rollout", 0.0))),
        "time_training": train,
    }
