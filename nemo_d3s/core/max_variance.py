"""Exact max-variance subset selection (the PODS lemma, arXiv 2504.13818), batched over rows: with
values sorted, some optimal m-subset is the k largest plus the m - k smallest. Float64 prefix sums,
O(n log n); deterministic (stable sorts), no collectives."""

from __future__ import annotations


import torch

from nemo_d3s.core.checks import check_finite, is_count

__all__ = ["max_variance_mask", "max_variance_subset"]

# Relative tolerance for "this k ties the best variance"; see max_variance_mask.
_VARIANCE_RTOL = 1e-10
_F64_EPS = torch.finfo(torch.float64).eps
_M1_TIE_RTOL = 1e-6  # relative: far above float32 advantages' rounding of the group mean


def max_variance_mask(values: torch.Tensor, m: int) -> torch.Tensor:
    """values [R, n], 1 <= m <= n -> keep [R, n] bool, m True per row, maximising each row's kept
    variance. O(R n log n) time, O(R n) float64 memory.

    Candidate k scores SS_k = sq_k - sum_k^2 / m on values shifted by the row median (no
    catastrophic cancellation). Ties, candidates within ``max(1e-10 best, 4 n eps64 total)`` of
    the best (so tied binary rewards do not flip on rounding): the one whose kept sum is closest
    to m x the row's mean, i.e. whose kept advantages sum closest to 0 (with 0/1 rewards at odd
    m the extra value comes from the row's majority; the smallest k alone always took it from
    the bottom, so a D3S-I step kept more negative advantages than positive, group after
    group); a tie of those too (a row balanced around its mean) takes the side of the row's
    first value (above its mean: the largest such k, else the smallest), a fair coin for
    i.i.d. rollouts that depends on the row alone. Among equal values the lower index is kept
    first. m = 1 has no variance to maximise (every value ties): the value farthest from the
    row's mean is kept (the largest |advantage|, of either sign; lower index on ties), where
    the smallest k kept the lowest (negative advantages only: a ``d3s_i`` run collapsed)."""
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [R, n], got shape {tuple(values.shape)}")
    n_rows, n = values.shape
    if not (is_count(m, 1) and m <= n):
        raise ValueError(f"m must be an int in [1, {n}] (the number of values per row), got {m!r}")
    if values.is_complex():
        raise ValueError(f"values must be real-valued, got dtype {values.dtype}")
    check_finite("values", values)
    device = values.device
    if n_rows == 0:
        return torch.zeros((0, n), dtype=torch.bool, device=device)
    if m == n:
        return torch.ones((n_rows, n), dtype=torch.bool, device=device)
    if m == 1:
        keep = torch.zeros((n_rows, n), dtype=torch.bool, device=device)
        keep.scatter_(1, _farthest_from_mean(values).unsqueeze(1), True)
        return keep

    v = values.to(torch.float64)
    # Stable ascending sort: within a run of equal values, lower original index comes first.
    sorted_v, perm = torch.sort(v, dim=1, stable=True)
    shifted = sorted_v - sorted_v[:, n // 2 : n // 2 + 1]
    zero = torch.zeros((n_rows, 1), dtype=torch.float64, device=device)
    p1 = torch.cat([zero, torch.cumsum(shifted, dim=1)], dim=1)  # [R, n+1]
    p2 = torch.cat([zero, torch.cumsum(shifted * shifted, dim=1)], dim=1)

    k = torch.arange(m + 1, device=device)  # taken from the top
    lo_end = (m - k).expand(n_rows, -1)  # bottom part: sorted positions [0, m-k)
    hi_start = (n - k).expand(n_rows, -1)  # top part: sorted positions [n-k, n)
    top1 = p1[:, n : n + 1] - p1.gather(1, hi_start)
    top2 = p2[:, n : n + 1] - p2.gather(1, hi_start)
    sum_k = p1.gather(1, lo_end) + top1
    sq_k = p2.gather(1, lo_end) + top2
    ss_k = sq_k - sum_k * sum_k / m  # [R, m+1]

    best = ss_k.max(dim=1, keepdim=True).values
    noise = 4.0 * n * _F64_EPS * p2[:, n : n + 1]
    tol = torch.maximum(_VARIANCE_RTOL * best.abs(), noise)
    near_best = ss_k >= best - tol
    # the tied candidates' distance from a kept set centred like the row, to rounding
    off = (sum_k - p1[:, n : n + 1] * (m / n)).abs()
    off = torch.where(near_best, off, torch.full_like(off, float("inf")))
    off_tol = 8.0 * n * _F64_EPS * shifted.abs().sum(dim=1, keepdim=True)
    centred = off <= off.min(dim=1, keepdim=True).values + off_tol  # [R, m+1]
    # argmax over a bool row returns the first True: the smallest qualifying k; over the
    # flipped row, the largest.
    k_small = centred.to(torch.uint8).argmax(dim=1, keepdim=True)  # [R, 1]
    k_large = m - centred.flip(1).to(torch.uint8).argmax(dim=1, keepdim=True)
    first_above = v[:, :1] * n > v.sum(dim=1, keepdim=True)  # the row's first value
    k_star = torch.where(first_above, k_large, k_small)

    pos = torch.arange(n, device=device).expand(n_rows, -1)
    chosen_sorted = (pos < (m - k_star)) | (pos >= (n - k_star))

    # Re-assign picks inside each run of equal values to the run's lowest original indices:
    # the top part would otherwise take the HIGHEST indices of a tied run (end of the
    # ascending order). The multiset of kept values, hence the variance, is unchanged.
    new_run = torch.ones((n_rows, n), dtype=torch.bool, device=device)
    new_run[:, 1:] = sorted_v[:, 1:] != sorted_v[:, :-1]
    run_start = torch.cummax(torch.where(new_run, pos, torch.zeros_like(pos)), dim=1).values
    run_id = torch.cumsum(new_run.to(torch.long), dim=1) - 1
    picks_per_run = torch.zeros((n_rows, n), dtype=torch.long, device=device)
    picks_per_run.scatter_add_(1, run_id, chosen_sorted.to(torch.long))
    chosen_sorted = (pos - run_start) < picks_per_run.gather(1, run_id)

    keep = torch.zeros((n_rows, n), dtype=torch.bool, device=device)
    keep.scatter_(1, perm, chosen_sorted)
    return keep


def _farthest_from_mean(values: torch.Tensor) -> torch.Tensor:
    """values [R, n] -> [R] long: per row, the column farthest from the row's mean (lower on
    ties)."""
    vals = values.to(torch.float64)
    dev = (vals - vals.mean(dim=1, keepdim=True)).abs()
    # Deviations equal up to rounding (2 of 4 successes: +-0.87 around a mean that is 0 only
    # up to rounding) tie, and the lower index wins.
    near = dev >= dev.amax(dim=1, keepdim=True) * (1 - _M1_TIE_RTOL)
    return near.to(torch.int8).argmax(dim=1)  # the first True


def max_variance_subset(values: torch.Tensor, m: int) -> torch.Tensor:
    """values [n] -> LongTensor [m] ascending: the m values of largest variance; ties as
    :func:`max_variance_mask`."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D [n], got shape {tuple(values.shape)}")
    if values.numel() == 0:
        raise ValueError(f"values is empty (shape {tuple(values.shape)}); need at least one value")
    if values.is_complex():
        raise ValueError(f"values must be real-valued, got dtype {values.dtype}")
    check_finite("values", values)
    n = values.numel()
    if not (is_count(m, 1) and m <= n):
        raise ValueError(f"m must be an int in [1, {n}] (the number of values), got {m!r}")
    return max_variance_mask(values.unsqueeze(0), int(m))[0].nonzero().flatten()
