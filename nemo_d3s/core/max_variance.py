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


def max_variance_mask(values: torch.Tensor, m: int) -> torch.Tensor:
    """values [R, n], 1 <= m <= n -> keep [R, n] bool, m True per row, maximising each row's kept
    variance. O(R n log n) time, O(R n) float64 memory.

    Candidate k scores SS_k = sq_k - sum_k^2 / m on values shifted by the row median (no
    catastrophic cancellation). Ties: among candidates within ``max(1e-10 best, 4 n eps64 total)``
    of the best the smallest k wins (tied binary rewards do not flip on rounding); among equal
    values the lower index is kept first."""
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
    # argmax over a bool row returns the first True: the smallest qualifying k.
    k_star = near_best.to(torch.uint8).argmax(dim=1, keepdim=True)  # [R, 1]

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
