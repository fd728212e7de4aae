"""Token top-K% over data-parallel ranks: the exact global threshold and the scopes peers use.

``global_exact``     exactly ceil(K x N_eligible_global) tokens, the set one process keeps
                     on the concatenated batch (ties: rank, then row-major index); only
                     counts travel (radix selection), never scores.
``local``            top ceil(K x N_local) of this call's tokens, no collective (ms-swift).
``gather_quantile``  all-gather every score, keep score >= quantile(1 - K) (TRL's
                     ``get_high_entropy_mask``); the count is only about K x N.

Radix selection: float32 scores map to order-preserving uint32 keys; the k-th largest key is found
digit by digit (``bits_per_round`` 8 or 16), one all-reduce SUM of a bucket histogram per round;
keys equal to the threshold are kept in global order via one all-gather of tie counts. Every rank
derives each decision from the same reduced counts, so a rank with no eligible token still joins
every collective. Collectives: <= 32 / bits_per_round all-reduces of 2^bits + 1 int64 (the extra
slot flags a non-finite score on any rank), at most one all-gather of one int64. Memory
O(local eligible) int64 keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.core.checks import check_count, is_real
from nemo_d3s.core.token_selection import check_scores
from nemo_d3s.core.registry import Registry
from nemo_d3s.core.token_selection import n_tokens_to_keep, top_k_batch, top_k_mask
from nemo_d3s.distributed.comm import (
    all_gather_counts,
    all_gather_varlen,
    exclusive_prefix,
    group_rank,
    is_single,
)

__all__ = [
    "DISTRIBUTED_TOKEN_SCOPES",
    "GlobalTokenSelection",
    "float_order_keys",
    "global_top_k_mask",
    "quantile_linear",
    "select_tokens_global",
    "TORCH_QUANTILE_MAX",
]

#: torch.quantile raises for inputs with more elements than this.
TORCH_QUANTILE_MAX = 1 << 24


@dataclass
class GlobalTokenSelection:
    """token_keep [B, S] bool (this rank's part); local and global counts (global None for
    ``local``); threshold: the score threshold for ``gather_quantile``."""

    token_keep: torch.Tensor
    n_eligible: int
    n_kept: int
    n_eligible_global: Optional[int]
    n_kept_global: Optional[int]
    threshold: Optional[float] = None


# ---------------------------------------------------------------------------- validation


def _check_k(k) -> None:
    check_count("k", k)


# ---------------------------------------------------------------------------- keys


def float_order_keys(x: torch.Tensor) -> torch.Tensor:
    """x [...] float -> int64 [...] in [0, 2^32) with a < b (as float32) iff key(a) < key(b); -0.0
    == +0.0; NaN gets a key by its sign bit, callers exclude it."""
    # float32 is the dtype of token scores; + 0.0 turns -0.0 into +0.0 (IEEE round-to-nearest).
    bits = (x.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits + (1 << 31), torch.bitwise_not(bits))


def _radix_select(
    keys: torch.Tensor, k_or_frac, group, bits_per_round: int, bad_input: bool
) -> Tuple[int, int, int, int, int]:
    """The k-th largest of all ranks' eligible ``keys`` [n] int64; ``k_or_frac``: k, or ("frac", K)
    resolved from the first histogram. Returns (k, n_global, prefix, shift, remaining): keep keys
    above ``prefix`` at ``shift`` plus ``remaining`` equal ones."""
    n_buckets = 1 << bits_per_round
    device = keys.device
    cand = keys
    prefix = 0
    remaining = 0
    k = n_global = 0
    for rnd in range(32 // bits_per_round):
        shift = 32 - bits_per_round * (rnd + 1)
        digits = (cand >> shift) & (n_buckets - 1)
        hist = torch.zeros(n_buckets + 1, dtype=torch.long, device=device)
        hist[:n_buckets] = torch.bincount(digits, minlength=n_buckets)
        hist[n_buckets] = int(bad_input)  # rides along: any rank's bad input fails all ranks
        dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=group)
        if rnd == 0:
            if int(hist[n_buckets]):
                raise ValueError(
                    f"scores must be finite on eligible positions; {int(hist[n_buckets])} "
                    "rank(s) of the group hold NaN or +-inf there"
                )
            n_global = int(hist[:n_buckets].sum())
            if isinstance(k_or_frac, tuple):
                k = n_tokens_to_keep(n_global, float(k_or_frac[1]))
            else:
                k = min(int(k_or_frac), n_global)
            if k == 0:
                return 0, n_global, 0, 32, 0
            remaining = k
        hist = hist[:n_buckets]
        at_or_above = torch.flip(torch.cumsum(torch.flip(hist, (0,)), 0), (0,))  # [d] = #digit >= d
        d_star = int((at_or_above >= remaining).nonzero().max())
        remaining -= int(at_or_above[d_star] - hist[d_star])
        prefix |= d_star << shift
        if int(hist[d_star]) == remaining:  # the whole bucket is kept: no threshold ties left
            return k, n_global, prefix, shift, 0
        cand = cand[digits == d_star]
    return k, n_global, prefix, 0, remaining


def _global_top_k(
    scores, eligible, k_or_frac, group, bits_per_round
) -> Tuple[torch.Tensor, int, int]:
    """Radix top-k over ``group``; returns (token_keep [B, S], k, n_eligible_global)."""
    if bits_per_round not in (4, 8, 16):
        raise ValueError(f"bits_per_round must be 4, 8 or 16, got {bits_per_round!r}")
    flat_elig = eligible.reshape(-1)
    vals = scores.reshape(-1)[flat_elig]
    bad = bool((~torch.isfinite(vals)).any()) if vals.numel() else False
    keys = float_order_keys(vals)
    k, n_global, prefix, shift, remaining = _radix_select(
        keys, k_or_frac, group, bits_per_round, bad
    )
    keep_vals = torch.zeros_like(keys, dtype=torch.bool)
    if k > 0:
        top = keys >> shift
        keep_vals = top > (prefix >> shift)
        if remaining == 0:
            keep_vals |= top == (prefix >> shift)
        else:
            ties = keys == prefix
            # Earlier ranks' ties come first; within a rank, lower flattened index first.
            counts = all_gather_counts(int(ties.sum()), group, keys.device)
            quota = remaining - int(exclusive_prefix(counts)[group_rank(group)])
            keep_vals |= ties & (torch.cumsum(ties.to(torch.long), 0) <= quota)
    keep = torch.zeros_like(flat_elig)
    keep[flat_elig] = keep_vals
    return keep.view(eligible.shape), k, n_global


def global_top_k_mask(
    scores: torch.Tensor,
    eligible: torch.Tensor,
    k: int,
    group: Optional[dist.ProcessGroup],
    *,
    bits_per_round: int = 8,
) -> torch.Tensor:
    """Exactly ``min(k, total eligible)`` tokens over all ranks of ``group``, highest score first,
    ties by (rank, b x S + s): scores, eligible [B, S], the same k everywhere -> bool [B, S]. B and
    S may differ between ranks. ``group=None`` or one rank: ``core.top_k_mask``."""
    # Non-finite scores are reported through the collective so every rank raises alike.
    check_scores(scores, eligible, finite=False)
    _check_k(k)
    if is_single(group):
        return top_k_mask(scores, eligible, int(k))
    return _global_top_k(scores, eligible, int(k), group, bits_per_round)[0]


# ---------------------------------------------------------------------------- quantile scope


def quantile_linear(values: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of a 1-D tensor, linear interpolation (``torch.quantile``'s), for any size:
    two ``kthvalue`` order statistics above ``torch.quantile``'s 2^24-element limit. Returns a 0-d
    tensor in ``values``' dtype."""
    n = values.numel()
    if n <= TORCH_QUANTILE_MAX:
        return torch.quantile(values, q)
    pos = float(q) * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    v_lo = torch.kthvalue(values, lo + 1).values
    v_hi = torch.kthvalue(values, hi + 1).values if hi != lo else v_lo
    return torch.lerp(v_lo, v_hi, torch.tensor(pos - lo, dtype=values.dtype, device=values.device))


def _gather_quantile(scores, eligible, k_frac, group) -> GlobalTokenSelection:
    local = scores[eligible].to(torch.float32)
    bad = not bool(torch.isfinite(local).all())
    # A bad rank announces itself in the size gather (count -1), so every rank raises
    # instead of the others waiting in the data gather.
    counts = all_gather_counts(-1 if bad else local.numel(), group, local.device)
    if bool((counts < 0).any()):
        raise ValueError(
            "scores must be finite on eligible positions (NaN or +-inf on some rank of the group)"
        )
    everything, _ = all_gather_varlen(local, group, counts)
    n_global = everything.numel()
    if n_global == 0:
        keep = torch.zeros_like(eligible)
        return GlobalTokenSelection(keep, 0, 0, 0, 0, None)
    threshold = quantile_linear(everything, 1.0 - float(k_frac))
    keep = eligible & (scores.to(torch.float32) >= threshold)
    n_kept_global = int((everything >= threshold).sum())
    return GlobalTokenSelection(
        keep, int(eligible.sum()), int(keep.sum()), n_global, n_kept_global, float(threshold)
    )


# ---------------------------------------------------------------------------- entry point


class DistributedTokenScope(Protocol):
    """A DP-batch token scope: scores, eligible [B, S], K, DP group -> GlobalTokenSelection."""

    def __call__(
        self,
        scores: torch.Tensor,
        eligible: torch.Tensor,
        k_frac: float,
        group: Optional[dist.ProcessGroup],
        *,
        bits_per_round: int,
    ) -> GlobalTokenSelection: ...


DISTRIBUTED_TOKEN_SCOPES: Registry = Registry(
    "distributed token selection scope", DistributedTokenScope
)


@DISTRIBUTED_TOKEN_SCOPES.register("global_exact")
def _scope_global_exact(
    scores, eligible, k_frac, group, *, bits_per_round=8
) -> GlobalTokenSelection:
    if is_single(group):
        n = int(eligible.sum())
        k = n_tokens_to_keep(n, float(k_frac))
        keep = top_k_mask(scores, eligible, k)
        return GlobalTokenSelection(keep, n, k, n, k)
    keep, k, n_global = _global_top_k(
        scores, eligible, ("frac", float(k_frac)), group, bits_per_round
    )
    return GlobalTokenSelection(keep, int(eligible.sum()), int(keep.sum()), n_global, k)


@DISTRIBUTED_TOKEN_SCOPES.register("local")
def _scope_local(scores, eligible, k_frac, group, *, bits_per_round=8) -> GlobalTokenSelection:
    keep = top_k_batch(scores, eligible, float(k_frac))
    return GlobalTokenSelection(keep, int(eligible.sum()), int(keep.sum()), None, None)


@DISTRIBUTED_TOKEN_SCOPES.register("gather_quantile")
def _scope_gather_quantile(
    scores, eligible, k_frac, group, *, bits_per_round=8
) -> GlobalTokenSelection:
    return _gather_quantile(scores, eligible, k_frac, None if is_single(group) else group)


def select_tokens_global(
    scores: torch.Tensor,
    eligible: torch.Tensor,
    k_frac: float,
    group: Optional[dist.ProcessGroup],
    *,
    scope: str = "global_exact",
    bits_per_round: int = 8,
) -> GlobalTokenSelection:
    """Keep the top ``k_frac`` of the eligible tokens in the pool ``scope`` defines: scores,
    eligible [B, S], the same K on every rank -> GlobalTokenSelection. Every rank of ``group`` calls
    it with the same scope. No eligible token anywhere: an all-False mask."""
    from nemo_d3s.core.checks import check_fraction

    # Non-finite scores are reported through the collective so every rank raises alike.
    check_scores(scores, eligible, finite=False)
    if not is_real(k_frac):
        raise ValueError(f"k_frac must be a real number in (0, 1], got {k_frac!r}")
    check_fraction("k_frac", float(k_frac))
    fn = DISTRIBUTED_TOKEN_SCOPES.get(scope)
    return fn(scores, eligible, float(k_frac), group, bits_per_round=bits_per_round)
