"""Off-policy correction: importance weights of the trainer's policy against the one that
sampled the rollouts (the engine's behaviour log-probs: stale weights, other numerics).

With d_t = old_t - behaviour_t on the response tokens (old: the trainer's log-probs at the
current weights, before the update), the ``token`` level ratio is r_t = exp(d_t); the
``sequence`` level one is the row's geometric mean exp(mean_t d_t), on every token of the row.
``truncate`` (truncated IS): weight min(r, c). ``mask`` (masked IS): weight r where 1/c <= r
<= c; elsewhere the token (sequence level: the whole row) is dropped from the loss. [B, S]
tensors, token-aligned; pure torch, no collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["IS_LEVELS", "IS_MODES", "ImportanceWeights", "importance_weights"]

IS_MODES = ("truncate", "mask")
IS_LEVELS = ("token", "sequence")


@dataclass
class ImportanceWeights:
    """weight [B, S] f32 (1 off the response); keep [B, S] bool (False where masked IS drops
    a response token); log_ratio [B, S] f32: log r at the chosen level (0 off the response)."""

    weight: torch.Tensor
    keep: torch.Tensor
    log_ratio: torch.Tensor


def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
    *,
    mode: str = "truncate",
    level: str = "token",
) -> ImportanceWeights:
    """The weights of the module docstring: old / behaviour log-probs [B, S], response_mask
    [B, S] bool, ``cap`` c >= 1."""
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {', '.join(IS_LEVELS)}, got {level!r}")
    if not cap >= 1:
        raise ValueError(f"cap must be >= 1, got {cap!r}")
    d = (old_logprobs - behaviour_logprobs).float()
    if level == "sequence":
        n = response_mask.sum(dim=1, keepdim=True).clamp(min=1)
        d = (torch.where(response_mask, d, 0.0).sum(dim=1, keepdim=True) / n).expand_as(d)
    log_ratio = torch.where(response_mask, d, 0.0)
    one = torch.ones_like(log_ratio)
    if mode == "truncate":
        w = torch.exp(log_ratio).clamp(max=float(cap))
        keep_all = torch.ones_like(response_mask)
        return ImportanceWeights(torch.where(response_mask, w, one), keep_all, log_ratio)
    inside = log_ratio.abs() <= math.log(float(cap))  # 1/c <= r <= c, on the log scale
    keep = response_mask & inside
    weight = torch.where(keep, torch.exp(log_ratio), one)
    return ImportanceWeights(weight, keep | ~response_mask, log_ratio)
