"""Per-step metrics, always global (over all data-parallel ranks).

Why recompute instead of forwarding the selectors' own metrics: a rank-local selector
reports rank-local numbers, and the JSONL must read the same with 1 or N ranks. The
inputs are small ([B_local] vectors and a few counters), gathered with fixed-size
all-gathers (every rank holds the same number of rollouts) or summed.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from nemo_d3s.backends.base import Rollouts
from nemo_d3s.core.advantages import compute_advantages
from nemo_d3s.core.losses import finalize_metrics
from nemo_d3s.trainer.dist import DPInfo

__all__ = ["rollout_metrics", "selection_metrics", "token_metrics", "update_metrics"]


def rollout_metrics(dp: DPInfo, rewards: torch.Tensor, group_ids: torch.Tensor, ro: Rollouts, n_errors: int) -> Dict[str, float]:
    """rewards [B_local] f32, group_ids [B_local] long (global prompt indices)."""
    r = dp.gather_cat(rewards.to(torch.float64))
    g = dp.gather_cat(group_ids)
    adv = compute_advantages(r, g, "grpo")
    resp_len = ro.batch.response_mask.sum(1).to(torch.float64)
    local = {
        "rollout_tokens": float(resp_len.sum()),
        "finished": float(ro.finished.sum()),
        "reward_errors": float(n_errors),
    }
    tot = dp.sum(local)
    n = r.numel()
    return {
        "n_prompts": float(adv.n_groups),
        "n_samples": float(n),
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()) if n > 1 else 0.0,
        "reward_max": float(r.max()),
        "n_degenerate_groups": float(adv.n_degenerate),
        "n_informative_groups": float(adv.n_groups - adv.n_degenerate),
        "response_len_mean": tot["rollout_tokens"] / n,
        "finished_frac": tot["finished"] / n,
        "rollout_tokens": tot["rollout_tokens"],
        "reward_errors": tot["reward_errors"],
    }


def selection_metrics(dp: DPInfo, stage: Any) -> Dict[str, float]:
    """From a SampleStage: how many rollouts survived and how spread their advantages are."""
    keep = dp.gather_cat(stage.sample_keep)
    adv = dp.gather_cat(stage.advantages.to(torch.float64))
    kept = adv[keep]
    n, k = keep.numel(), int(keep.sum())
    out = {
        "n_kept_samples": float(k),
        "kept_sample_ratio": k / max(n, 1),
        "kept_adv_var": float(kept.var()) if k > 1 else 0.0,
        "kept_adv_abs_mean": float(kept.abs().mean()) if k else 0.0,
        "share_nonzero_adv": float((kept != 0).double().mean()) if k else 0.0,
    }
    out["n_keep"] = float(stage.n_keep)  # the schedule's N (a count, or a fraction of G)
    return out


def token_metrics(
    dp: DPInfo, tok: Any, kept: Any, entropy: Optional[torch.Tensor], scored: bool
) -> Dict[str, float]:
    """From a TokenStage and the kept samples' TokenBatch ([B_kept, S]); ``scored``: whether
    the old-log-prob/entropy pass ran over them (its cost is ``logprob_tokens``)."""
    keep, response_mask = tok.token_keep, kept.response_mask
    local = {
        "logprob_tokens": float(kept.attention_mask.sum()) if scored else 0.0,
        "n_eligible_tokens": float(response_mask.sum()),
        "n_kept_tokens": float(keep.sum()),
        "samples_without_tokens": float((response_mask.any(1) & ~keep.any(1)).sum()),
    }
    if entropy is not None:
        local["entropy_kept_sum"] = float(entropy[keep].double().sum())
        local["entropy_eligible_sum"] = float(entropy[response_mask].double().sum())
    t = dp.sum(local)
    out = {
        "logprob_tokens": t["logprob_tokens"],
        "k_frac": float(tok.k_frac),
        "n_eligible_tokens": t["n_eligible_tokens"],
        "n_kept_tokens": t["n_kept_tokens"],
        "kept_token_ratio": t["n_kept_tokens"] / max(t["n_eligible_tokens"], 1.0),
        "samples_without_tokens": t["samples_without_tokens"],
    }
    if entropy is not None:
        out["mean_entropy_kept"] = t["entropy_kept_sum"] / max(t["n_kept_tokens"], 1.0)
        out["mean_entropy_eligible"] = t["entropy_eligible_sum"] / max(t["n_eligible_tokens"], 1.0)
    return out


def update_metrics(dp: DPInfo, upd: Any, report: Dict[str, float]) -> Dict[str, float]:
    """From the UpdateBatch and ``update_policy``'s report (rank-local sums)."""
    steps = max(report.get("optimizer_steps", 0.0), 1.0)
    # Loss-side sums add across ranks; grad_norm/lr are already identical on every rank.
    same_everywhere = {"optimizer_steps", "grad_norm", "lr"}
    local = {k: v for k, v in report.items() if k not in same_everywhere}
    local["update_rows"] = float(len(upd))
    t = dp.sum(local)
    out = {
        "update_tokens": t.pop("update_tokens_local"),
        "update_rows": t.pop("update_rows"),
        "optimizer_steps": report.get("optimizer_steps", 0.0),
        "grad_norm": report.get("grad_norm", 0.0) / steps,
        "lr": report.get("lr", 0.0),
    }
    # loss / pg_loss / kl_loss are per-optimizer-step values (already divided by the global
    # denominator); report their mean over the step's mini-batches.
    for key in ("loss", "pg_loss", "kl_loss"):
        if key in t:
            t[key] = t[key] / steps
    out.update(finalize_metrics(t))
    return out
