"""Token-level down-sampling (D3S stage 2): which response tokens of the kept rollouts get a
gradient.

Each eligible token is scored ``|A_i,t| x H_i,t`` (H: old-policy entropy, token-aligned) and a
fraction K in (0, 1] of the eligible tokens is kept: exactly ``ceil(K x n_eligible)``
(:func:`n_tokens_to_keep`), per scope (``TOKEN_SELECTORS``): ``all`` (every token), ``batch`` (one
pool; the DP-global variant is in ``nemo_d3s.distributed``), ``sample`` (per row). Ties go to the
lower row-major index (a stable sort: ``torch.topk`` promises no order), so every device and rank
gets the same mask. Pure torch, no collectives."""

from __future__ import annotations

from typing import Protocol
import math
import numbers
from dataclasses import dataclass

import torch

from nemo_d3s.core.checks import (
    is_real,
    check_count,
    broadcast_per_row,
    check_finite,
    check_fraction,
    check_mask_2d,
    check_same_device,
    check_shape,
)
from nemo_d3s.core.registry import Registry

__all__ = [
    "TOKEN_SELECTORS",
    "TokenRule",
    "TokenSelection",
    "token_scores",
    "top_k_mask",
    "n_tokens_to_keep",
    "n_tokens_to_keep_per_row",
    "k_frac_with_floor",
    "select_tokens",
    "rows_with_kept_tokens",
    "kept_lengths",
]


class TokenRule(Protocol):
    """A token selection scope: scores [B, S], eligible [B, S] bool, K = k_frac in (0, 1]
    -> token_keep [B, S] bool."""

    def __call__(
        self, scores: torch.Tensor, eligible: torch.Tensor, k_frac: float
    ) -> torch.Tensor: ...


TOKEN_SELECTORS: Registry = Registry(
    "token selection scope",
    TokenRule,
    # needs_entropy: scores are |A| x H, so the old-policy entropy pass must run (False only
    # for a scope that keeps every eligible token, where K is reported as 1.0).
    # spans_batch: K is a fraction of the whole optimizer-step batch (all DP ranks), not of
    # one row, so the threshold needs a DP-global collective.
    needs_entropy=True,
    spans_batch=False,
)

# K arrives as a binary float (0.1 is 0.1000000000000000055...), so K x n can land a hair
# above an integer (0.1 x 30 = 3.0000000000000004) and a plain ceil would keep one token
# too many. Shrinking the product by a relative 1e-12 removes that representation error
# (which is ~1e-16 relative) while changing no honest count below ~10^12 tokens.
_CEIL_RTOL = 1e-12


# ---------------------------------------------------------------------------- validation


def _check_k_frac(k_frac) -> None:
    if not is_real(k_frac):
        raise ValueError(f"k_frac must be a real number in (0, 1], got {k_frac!r}")
    check_fraction("k_frac", float(k_frac))


def check_scores(scores: torch.Tensor, eligible: torch.Tensor, *, finite: bool = True) -> None:
    """ValueError naming the argument unless eligible is a [B, S] bool mask and scores a
    floating-point [B, S] tensor on its device, finite where eligible (``finite=False`` leaves that
    to a caller that must fail on all ranks alike)."""
    check_mask_2d("eligible", eligible)
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a floating-point tensor [B, S], got {got}")
    check_shape("scores", scores, eligible.shape, "eligible")
    check_same_device(scores=scores, eligible=eligible)
    if finite:
        check_finite("scores (on eligible positions)", scores, eligible)


# ---------------------------------------------------------------------------- counts


def n_tokens_to_keep(n_eligible: int, k_frac: float) -> int:
    """``ceil(k_frac x n_eligible)``; n_eligible an int or a one-element integer tensor.

    A product within a relative 1e-12 above an integer is that integer, so the decimal K a user
    types is exact (``n_tokens_to_keep(30, 0.1) == 3``)."""
    if (
        isinstance(n_eligible, torch.Tensor)
        and n_eligible.numel() == 1
        and not n_eligible.is_floating_point()
        and n_eligible.dtype != torch.bool
    ):
        n_eligible = int(n_eligible)  # e.g. an all-reduced count
    if (
        isinstance(n_eligible, bool)
        or not isinstance(n_eligible, numbers.Integral)
        or n_eligible < 0
    ):
        raise ValueError(f"n_eligible must be an int >= 0, got {n_eligible!r}")
    _check_k_frac(k_frac)
    n = int(n_eligible)
    # Same float64 operations, in the same order, as n_tokens_to_keep_per_row.
    k = math.ceil((float(k_frac) * float(n)) * (1.0 - _CEIL_RTOL))
    return min(max(k, 0), n)


def k_frac_with_floor(k_frac: float, n_eligible: int, min_tokens: int) -> float:
    """``max(K, min(1, min_tokens / n_eligible))``: K raised so that a pool keeps at least
    ``min_tokens`` tokens (all when it holds fewer).

    ``n_eligible`` counts the scope's whole pool (all DP ranks for ``batch``, so every rank gets the
    same K). For ``batch``, ``n_tokens_to_keep(n, k_frac_with_floor(K, n, M)) == max(ceil(K x n),
    min(M, n))`` exactly."""
    _check_k_frac(k_frac)
    for name, v in (("n_eligible", n_eligible), ("min_tokens", min_tokens)):
        check_count(name, v)
    if min_tokens == 0 or n_eligible == 0:
        return float(k_frac)
    return max(float(k_frac), min(1.0, int(min_tokens) / int(n_eligible)))


def n_tokens_to_keep_per_row(n_eligible: torch.Tensor, k_frac: float) -> torch.Tensor:
    """Vectorised :func:`n_tokens_to_keep`: n_eligible [B] integer -> [B] long; float64 with the
    scalar's operations, so both agree exactly below 2^53."""
    _check_k_frac(k_frac)
    if n_eligible.is_floating_point() or n_eligible.dtype == torch.bool:
        raise ValueError(f"n_eligible must be an integer tensor, got dtype {n_eligible.dtype}")
    if n_eligible.numel() and int(n_eligible.min()) < 0:
        raise ValueError(f"n_eligible must be >= 0, got min {int(n_eligible.min())}")
    x = (float(k_frac) * n_eligible.to(torch.float64)) * (1.0 - _CEIL_RTOL)
    k = torch.ceil(x).to(torch.long)
    return torch.minimum(k.clamp(min=0), n_eligible.to(torch.long))


# ---------------------------------------------------------------------------- scores


def token_scores(
    advantages: torch.Tensor, entropy: torch.Tensor, eligible: torch.Tensor
) -> torch.Tensor:
    """D3S token scores ``|A| x H``: advantages [B] or [B, S], entropy [B, S], eligible [B, S] bool
    -> [B, S] f32, exactly 0 off ``eligible`` (NaN there is never read). ValueError on NaN/inf at
    eligible positions."""
    check_mask_2d("eligible", eligible)
    for name, t in (("advantages", advantages), ("entropy", entropy)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating-point tensor, got {got}")
    check_shape("entropy", entropy, eligible.shape, "eligible")
    B, S = eligible.shape
    adv = broadcast_per_row("advantages", advantages, B, S, "eligible")
    check_same_device(advantages=advantages, entropy=entropy, eligible=eligible)
    check_finite("advantages (on eligible positions)", adv, eligible)
    check_finite("entropy (on eligible positions)", entropy, eligible)
    # float32 on every rank, so the ranking (hence the selection) cannot depend on which
    # dtype a backend happened to return.
    score = adv.to(torch.float32).abs() * entropy.to(torch.float32)
    return torch.where(eligible, score, torch.zeros((), dtype=torch.float32, device=score.device))


# ---------------------------------------------------------------------------- top-k


def top_k_mask(scores: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """The ``min(k, eligible.sum())`` highest-scoring eligible tokens: [B, S] -> bool [B, S]; ties
    to the lower flattened index. One stable sort, O(n log n)."""
    check_scores(scores, eligible)
    check_count("k", k)
    return _top_k_flat(scores, eligible, int(k))


def _top_k_flat(scores: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_k_mask` without the input checks (callers have validated)."""
    keep = torch.zeros(eligible.numel(), dtype=torch.bool, device=eligible.device)
    # nonzero() lists indices in ascending order; a stable sort then keeps the lower index
    # first among equal scores.
    idx = eligible.reshape(-1).nonzero().squeeze(1)
    k = min(int(k), idx.numel())
    if k > 0:
        vals = scores.reshape(-1)[idx]
        order = torch.sort(vals, descending=True, stable=True).indices[:k]
        keep[idx[order]] = True
    return keep.view(eligible.shape)


def _top_k_per_row(
    scores: torch.Tensor, eligible: torch.Tensor, k_row: torch.Tensor
) -> torch.Tensor:
    """Top ``k_row[b]`` eligible tokens of each row (k_row [B] long) -> bool [B, S]; one batched
    stable sort, ties to the lower position."""
    B, S = eligible.shape
    if B == 0 or S == 0:
        return torch.zeros_like(eligible)
    # Non-eligible positions sink below every eligible (finite) score.
    key = torch.where(
        eligible, scores, torch.full((), -math.inf, dtype=scores.dtype, device=scores.device)
    )
    order = torch.sort(key, dim=1, descending=True, stable=True).indices  # [B, S]
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(S, device=order.device).expand(B, S))
    return (rank < k_row.unsqueeze(1)) & eligible


@TOKEN_SELECTORS.register("all", needs_entropy=False)
def keep_all_tokens(scores: torch.Tensor, eligible: torch.Tensor, k_frac: float) -> torch.Tensor:
    """Every eligible token (K ignored, but still validated). [B, S] -> [B, S] bool."""
    check_scores(scores, eligible)
    _check_k_frac(k_frac)
    return eligible.clone()


@TOKEN_SELECTORS.register("batch", spans_batch=True)
def top_k_batch(scores: torch.Tensor, eligible: torch.Tensor, k_frac: float) -> torch.Tensor:
    """Top ``ceil(K x eligible.sum())`` over all B x S tokens given. [B, S] -> [B, S] bool."""
    check_scores(scores, eligible)
    _check_k_frac(k_frac)
    return _top_k_flat(scores, eligible, n_tokens_to_keep(int(eligible.sum()), k_frac))


@TOKEN_SELECTORS.register("sample")
def top_k_per_sample(scores: torch.Tensor, eligible: torch.Tensor, k_frac: float) -> torch.Tensor:
    """Top ``ceil(K x eligible[b].sum())`` within each row b. [B, S] -> [B, S] bool."""
    check_scores(scores, eligible)
    _check_k_frac(k_frac)
    k_row = n_tokens_to_keep_per_row(eligible.sum(dim=1), k_frac)
    return _top_k_per_row(scores, eligible, k_row)


# ---------------------------------------------------------------------------- entry point


@dataclass
class TokenSelection:
    """Result of :func:`select_tokens`: token_keep [B, S] bool (within ``eligible``) and counts.
    ``samples_without_tokens``: rows with eligible tokens that kept none (scope ``batch`` only);
    ``samples_without_eligible``: rows with no eligible token."""

    token_keep: torch.Tensor
    n_eligible: int
    n_kept: int
    samples_without_tokens: int
    samples_without_eligible: int = 0


def select_tokens(
    scores: torch.Tensor, eligible: torch.Tensor, k_frac: float, scope: str = "batch"
) -> TokenSelection:
    """Apply the ``TOKEN_SELECTORS`` scope ``scope``: scores, eligible [B, S] -> TokenSelection.

    ValueError when ``eligible`` holds no token: the caller must skip the batch rather than divide
    by a zero denominator (the scope functions themselves return an all-False mask, for shard-local
    callers)."""
    selector = TOKEN_SELECTORS.get(scope)
    check_scores(scores, eligible)
    _check_k_frac(k_frac)
    has_eligible = eligible.any(dim=1)
    n_eligible = int(eligible.sum())
    if n_eligible == 0:
        raise ValueError(
            f"eligible selects no token (shape {tuple(eligible.shape)}, 0 True); "
            "skip this batch instead of selecting tokens from it"
        )
    token_keep = selector(scores, eligible, k_frac)
    return TokenSelection(
        token_keep=token_keep,
        n_eligible=n_eligible,
        n_kept=int(token_keep.sum()),
        samples_without_tokens=int((has_eligible & ~token_keep.any(dim=1)).sum()),
        samples_without_eligible=int((~has_eligible).sum()),
    )


# ---------------------------------------------------------------------------- compaction


def rows_with_kept_tokens(token_keep: torch.Tensor) -> torch.Tensor:
    """token_keep [B, S] -> [U] long, ascending: the rows with a kept token (the others contribute
    nothing to the loss)."""
    check_mask_2d("token_keep", token_keep)
    return token_keep.any(dim=1).nonzero().squeeze(1)


def kept_lengths(token_keep: torch.Tensor) -> torch.Tensor:
    """token_keep [B, S] -> [B] long: 1 + position of the row's last kept token (0 if none). A
    causal model's loss at t reads positions <= t only, so cutting rows there changes no kept
    token's loss or gradient."""
    check_mask_2d("token_keep", token_keep)
    B, S = token_keep.shape
    if S == 0:
        return torch.zeros(B, dtype=torch.long, device=token_keep.device)
    positions = torch.arange(1, S + 1, device=token_keep.device)
    return (token_keep.to(torch.long) * positions).amax(dim=1)
