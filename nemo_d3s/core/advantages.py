"""Group-relative advantages for outcome rewards (GRPO family), over the rollouts of each prompt.

``grpo``: A_i = (r_i - mean_g) / (std_g + eps); ``dr_grpo``: A_i = r_i - mean_g; ``rloo``:
A_i = r_i - mean of the other rollouts = G / (G - 1) (r_i - mean_g).

Group ids are arbitrary integers; groups may differ in size. An all-equal group (G = 1 included) is
degenerate and gets exactly 0, so ``A != 0`` is a reliable test downstream. Arithmetic is float64
(rounding residues of 0.1-like rewards survive the std division), output float32. Groups are reduced
row-wise in one [R, G] matrix per distinct size, never with CUDA-atomic ``index_add_``, so the
result is deterministic. Memory O(B + n_groups)."""

from __future__ import annotations

from typing import Protocol
import math
from dataclasses import dataclass

import torch

from nemo_d3s.core.checks import check_finite, check_same_device
from nemo_d3s.core.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageResult",
    "compute_advantages",
    "group_index",
    "group_sizes",
    "group_buckets",
    "degenerate_groups",
]


class AdvantageEstimator(Protocol):
    """An advantage estimator: rewards [B] real, group_ids [B] integer -> advantages [B] f32."""

    def __call__(
        self, rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float, unbiased: bool
    ) -> torch.Tensor: ...


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", AdvantageEstimator)


# ----------------------------------------------------------------------------------------
# validation and group bookkeeping
# ----------------------------------------------------------------------------------------


def check_group_ids(group_ids: torch.Tensor, name: str = "group_ids") -> None:
    """ValueError unless ``group_ids`` is a non-empty 1-D [B] integer tensor."""
    if not isinstance(group_ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(group_ids).__name__}")
    if group_ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(group_ids.shape)}")
    if group_ids.numel() == 0:
        raise ValueError(
            f"{name} is empty (shape {tuple(group_ids.shape)}); need at least one sample"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"{name} must be an integer tensor (e.g. torch.long), got dtype {group_ids.dtype}"
        )


def check_rewards(rewards: torch.Tensor, name: str = "rewards") -> None:
    """ValueError unless ``rewards`` is a non-empty 1-D [B] real tensor of finite values."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError(
            f"{name} is empty (shape {tuple(rewards.shape)}); need at least one sample"
        )
    if rewards.is_complex():
        raise ValueError(f"{name} must be real-valued, got dtype {rewards.dtype}")
    check_finite(name, rewards)


def check_eps(eps: float) -> None:
    """ValueError unless ``eps`` is a finite number >= 0."""
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float))
        or not math.isfinite(eps)
        or eps < 0
    ):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


def _check_rewards_and_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    check_rewards(rewards)
    check_group_ids(group_ids)
    if rewards.shape != group_ids.shape:
        raise ValueError(
            f"group_ids has shape {tuple(group_ids.shape)}, expected "
            f"{tuple(rewards.shape)} (the shape of rewards)"
        )
    check_same_device(rewards=rewards, group_ids=group_ids)


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """group_ids [B] integer -> (index [B] long in 0..n_groups-1, n_groups), numbered in order of
    first appearance, so the numbering does not depend on the id values."""
    check_group_ids(group_ids)
    uniq, inverse = torch.unique(group_ids, return_inverse=True)  # sorted by id value
    n_groups = int(uniq.numel())
    b = group_ids.numel()
    positions = torch.arange(b, device=group_ids.device)
    first_seen = torch.full((n_groups,), b, dtype=torch.long, device=group_ids.device)
    first_seen.scatter_reduce_(0, inverse, positions, reduce="amin", include_self=True)
    # First positions are distinct, so this argsort has no ties to break.
    by_appearance = torch.argsort(first_seen)
    rank = torch.empty_like(by_appearance)
    rank[by_appearance] = torch.arange(n_groups, device=group_ids.device)
    return rank[inverse], n_groups


def group_sizes(index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """index [B] long (from :func:`group_index`) -> rollouts per group [n_groups] long."""
    return torch.bincount(index, minlength=n_groups)


def group_buckets(
    index: torch.Tensor, n_groups: int
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """index [B] -> one ``(G, groups [R], layout [R, G])`` per distinct group size, ascending: the
    dense ids of the R groups of size G and their sample indices, ascending (a lower column is a
    lower sample). Loops over sizes (at most sqrt(2B)), never groups. Memory O(B)."""
    b = index.numel()
    device = index.device
    sizes = group_sizes(index, n_groups)
    # Stable: inside a group, samples keep ascending index order.
    by_group = torch.sort(index, stable=True).indices
    starts = torch.cumsum(sizes, 0) - sizes
    col = torch.empty_like(index)
    col[by_group] = torch.arange(b, device=device) - starts[index[by_group]]
    buckets = []
    for g_size in torch.unique(sizes).tolist():
        in_bucket = sizes == g_size
        groups = in_bucket.nonzero().flatten()
        row_of_group = torch.cumsum(in_bucket.to(torch.long), 0) - 1
        samples = in_bucket[index].nonzero().flatten()
        layout = torch.empty((groups.numel(), g_size), dtype=torch.long, device=device)
        layout[row_of_group[index[samples]], col[samples]] = samples
        buckets.append((int(g_size), groups, layout))
    return buckets


def degenerate_groups(rewards: torch.Tensor, index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[n_groups] bool: the group's rewards are all equal (G = 1 included). Exact max == min: a
    tolerance would misclassify genuinely different continuous rewards."""
    r = rewards.to(torch.float64)
    hi = torch.full((n_groups,), -math.inf, dtype=torch.float64, device=r.device)
    lo = torch.full((n_groups,), math.inf, dtype=torch.float64, device=r.device)
    hi.scatter_reduce_(0, index, r, reduce="amax", include_self=True)
    lo.scatter_reduce_(0, index, r, reduce="amin", include_self=True)
    return hi == lo


# ----------------------------------------------------------------------------------------
# group statistics (float64)
# ----------------------------------------------------------------------------------------


def _row_advantages(
    x: torch.Tensor, kind: str, eps: float, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, G] f64 -> (advantages [R, G] f64, degenerate [R] bool)."""
    g = x.shape[1]
    degenerate = x.amax(dim=1) == x.amin(dim=1)  # includes G = 1
    centered = x - x.mean(dim=1, keepdim=True)
    if kind == "grpo":
        # G = 1 with the unbiased estimator would divide 0 by 0; such groups are degenerate
        # and zeroed below, so any finite denominator works.
        dof = max(g - 1, 1) if unbiased else g
        std = torch.sqrt((centered * centered).sum(dim=1, keepdim=True) / dof)
        adv = centered / (std + eps)
    elif kind == "dr_grpo":
        adv = centered
    elif kind == "rloo":
        # r - (sum - r)/(G-1) = G/(G-1) * (r - mean): the mean of the others, without a second pass.
        adv = centered * (g / max(g - 1, 1))
    else:  # pragma: no cover - internal callers pass known kinds
        raise ValueError(f"unknown advantage kind {kind!r}")
    adv = torch.where(degenerate.unsqueeze(1), torch.zeros_like(adv), adv)
    return adv, degenerate


def grouped_advantages(
    rewards: torch.Tensor,
    index: torch.Tensor,
    n_groups: int,
    kind: str,
    eps: float,
    unbiased: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel of all estimators (PODS re-uses it on the kept subset): rewards [B], index [B] ->
    (advantages [B] f64, degenerate [n_groups] bool)."""
    r = rewards.to(torch.float64)
    adv = torch.zeros_like(r)
    degenerate = torch.zeros(n_groups, dtype=torch.bool, device=r.device)
    for _, groups, layout in group_buckets(index, n_groups):
        row_adv, row_deg = _row_advantages(r[layout], kind, eps, unbiased)
        adv[layout] = row_adv
        degenerate[groups] = row_deg
    return adv, degenerate


# ----------------------------------------------------------------------------------------
# registered estimators
# ----------------------------------------------------------------------------------------


def _run_estimator(
    kind: str, rewards: torch.Tensor, group_ids: torch.Tensor, eps: float, unbiased: bool
) -> torch.Tensor:
    _check_rewards_and_groups(rewards, group_ids)
    check_eps(eps)
    index, n_groups = group_index(group_ids)
    adv, _ = grouped_advantages(rewards, index, n_groups, kind, eps, bool(unbiased))
    return adv.to(torch.float32)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, unbiased: bool = True
) -> torch.Tensor:
    """GRPO: (r - mean_g) / (std_g + eps), std over G - 1 when ``unbiased``; [B] -> [B] f32."""
    return _run_estimator("grpo", rewards, group_ids, eps, unbiased)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, unbiased: bool = True
) -> torch.Tensor:
    """Dr. GRPO: r - mean_g (``eps``, ``unbiased`` unused); [B] -> [B] f32."""
    return _run_estimator("dr_grpo", rewards, group_ids, eps, unbiased)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, unbiased: bool = True
) -> torch.Tensor:
    """RLOO: r_i minus the mean of the group's other rewards (0 when G = 1); [B] -> [B] f32."""
    return _run_estimator("rloo", rewards, group_ids, eps, unbiased)


# ----------------------------------------------------------------------------------------
# front door
# ----------------------------------------------------------------------------------------


@dataclass
class AdvantageResult:
    """advantages [B] f32; group_index [B] long (first-appearance order); degenerate_groups
    [n_groups] bool."""

    advantages: torch.Tensor
    group_index: torch.Tensor
    n_groups: int
    degenerate_groups: torch.Tensor
    n_degenerate: int


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: str = "grpo",
    *,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> AdvantageResult:
    """Advantages over the FULL groups (before down-sampling): rewards [B], group_ids [B] ->
    :class:`AdvantageResult`; ``estimator`` names an ``ADVANTAGE_ESTIMATORS`` entry."""
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    _check_rewards_and_groups(rewards, group_ids)
    check_eps(eps)
    index, n_groups = group_index(group_ids)
    # The dense index is itself a valid id tensor, so registered (possibly third-party)
    # estimators are called through their public signature without re-validating raw ids.
    advantages = fn(rewards, index, eps=eps, unbiased=unbiased)
    degenerate = degenerate_groups(rewards, index, n_groups)
    return AdvantageResult(
        advantages=advantages.to(torch.float32),
        group_index=index,
        n_groups=n_groups,
        degenerate_groups=degenerate,
        n_degenerate=int(degenerate.sum()),
    )
