"""Exact quantiles of values spread over ranks, by radix selection on order-preserving keys
(``topk.float_order_keys``): only bucket counts travel, never the values.

For N values over all ranks the q-quantile is the value of 0-based rank floor(q (N - 1)) in
ascending order (``torch.quantile``'s ``interpolation="lower"``). Four rounds of 8 bits each;
each round one all-reduce SUM of [n_q, 257] int64 (the extra slot flags a non-finite value on
any rank), whatever the number of values. Every rank gets the same floats.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_d3s.distributed.comm import is_single
from nemo_d3s.distributed.topk import float_order_keys

__all__ = ["global_quantiles", "key_to_float"]

BITS = 8


def key_to_float(key: int) -> float:
    """The float32 value of an order key (the inverse of ``float_order_keys``)."""
    bits = key - (1 << 31) if key >= (1 << 31) else ~key
    return float(torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32))


def global_quantiles(
    values: torch.Tensor,
    qs: Sequence[float],
    group: Optional[dist.ProcessGroup],
    device: Optional[torch.device] = None,
) -> List[float]:
    """The ``qs`` quantiles (each in [0, 1]) of every rank's ``values`` [n_r] (n_r may be 0)
    as float32 numbers; NaN for each when no rank holds a value. ValueError on every rank when
    any holds a non-finite value. ``device``: where the histograms travel (the group's)."""
    if any(not 0.0 <= float(q) <= 1.0 for q in qs):
        raise ValueError(f"quantiles must lie in [0, 1], got {list(qs)}")
    device = device if device is not None else values.device
    flat = values.reshape(-1).float()
    bad = bool((~torch.isfinite(flat)).any()) if flat.numel() else False
    keys = float_order_keys(flat).to(device)
    n_q, buckets = len(qs), 1 << BITS
    prefix = [0] * n_q
    target: List[int] = [0] * n_q  # 0-based rank among the values under prefix
    for rnd in range(32 // BITS):
        shift = 32 - BITS * (rnd + 1)
        hist = torch.zeros(n_q, buckets + 1, dtype=torch.long, device=device)
        for i in range(n_q):
            cand = (
                keys
                if rnd == 0
                else keys[(keys >> (shift + BITS)) == (prefix[i] >> (shift + BITS))]
            )
            hist[i, :buckets] = torch.bincount((cand >> shift) & (buckets - 1), minlength=buckets)
        hist[:, buckets] = int(bad)
        if not is_single(group):
            dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=group)
        if rnd == 0:
            if int(hist[0, buckets]):
                raise ValueError(
                    f"values must be finite; {int(hist[0, buckets])} rank(s) hold NaN or +-inf"
                )
            n = int(hist[0, :buckets].sum())
            if n == 0:
                return [math.nan] * n_q
            target = [int(math.floor(float(q) * (n - 1))) for q in qs]
        counts = hist[:, :buckets].cpu()
        below = torch.cumsum(counts, dim=1)  # [i, d] = values with digit <= d
        for i in range(n_q):
            d = int((below[i] > target[i]).nonzero()[0])
            target[i] -= int(below[i, d] - counts[i, d])
            prefix[i] |= d << shift
    return [key_to_float(p) for p in prefix]
