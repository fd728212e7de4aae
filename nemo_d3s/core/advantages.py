"""Group-relative advantages for outcome rewards (GRPO family).

Every rollout ``i`` belongs to the group ``g(i)`` of rollouts sampled for the same prompt.
With ``mean_g``, ``std_g`` the mean and standard deviation of the rewards of group ``g``:

- ``grpo``:    A_i = (r_i - mean_g) / (std_g + eps)       (GRPO; std unbiased or biased)
- ``dr_grpo``: A_i = r_i - mean_g                         (Dr. GRPO: no std division)
- ``rloo``:    A_i = r_i - mean of the OTHER rollouts     (RLOO leave-one-out baseline)
                   = G / (G - 1) * (r_i - mean_g)

Conventions shared by all estimators:

- Group ids are arbitrary integers (not contiguous, not sorted); groups may differ in size.
- A group whose rewards are all equal carries no learning signal: its advantages are
  exactly 0 (not "0 up to rounding", so ``A != 0`` is a reliable test downstream) and it is
  reported as degenerate. A group of one rollout (G = 1) is degenerate too: its std and its
  leave-one-out baseline are undefined.
- Arithmetic is float64 (rewards like 0.1 summed over large groups otherwise leave a
  rounding residue that survives the std division); the result is float32.
- Vectorised, with no Python loop over groups: samples are gathered into one
  [n_groups_of_size_G, G] matrix per DISTINCT group size (:func:`group_buckets`; one matrix
  when all groups have the same size) and reduced along rows. Row reductions are
  deterministic on every device, unlike ``index_add_``/``scatter_add_`` whose CUDA atomics
  make float sums differ run to run, and selection downstream must not flip on such noise.
  Memory: O(B + n_groups).
"""

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
    """Map arbitrary integer group ids to dense indices.

    group_ids [B] integer -> (index [B] long in 0..n_groups-1, n_groups). Groups are numbered
    in order of FIRST APPEARANCE in ``group_ids`` (not by id value), so the numbering is the
    same whatever ids a data loader happens to use, and deterministic.
    """
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
    """Dense per-size layout of the groups, for row-wise (batched) group computations.

    index [B] long (from :func:`group_index`) -> one ``(G, groups [R] long, layout [R, G] long)``
    per distinct group size G, ascending in G: ``groups`` are the dense indices of the R
    groups of that size (ascending) and ``layout[i]`` the sample indices of ``groups[i]``,
    ascending, so a lower column is a lower sample index. Every sample appears exactly once
    over all layouts. The Python loop runs over distinct SIZES (at most sqrt(2B) of them;
    one in the usual equal-G batch), never over groups. Memory O(B).
    """
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
    """[n_groups] bool: True where the group's rewards are all equal (includes G = 1).

    Uses exact equality of max and min: rewards are usually discrete (0/1, format bonuses),
    and a tolerance would misclassify genuinely different continuous rewards. (amax/amin do
    not depend on reduction order, so the scatter is deterministic.)
    """
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
    """x [R, G] f64 rewards of R groups of size G -> (advantages [R, G] f64, degenerate [R]
    bool)."""
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
    """The shared kernel of all estimators (also used by PODS on the kept subset).

    rewards [B] (any real dtype), index [B] long dense -> (advantages [B] f64, degenerate [n_groups]
    bool).
    """
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
    """GRPO: A = (r - mean_g) / (std_g + eps).

    rewards [B] real, group_ids [B] integer -> advantages [B] f32. ``unbiased`` selects the
    (G-1) (True) or G (False) std denominator. All-equal and single-rollout groups give 0.
    """
    return _run_estimator("grpo", rewards, group_ids, eps, unbiased)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, unbiased: bool = True
) -> torch.Tensor:
    """Dr. GRPO: A = r - mean_g. ``eps`` and ``unbiased`` are accepted for the common
    signature and unused. rewards [B], group_ids [B] -> advantages [B] f32."""
    return _run_estimator("dr_grpo", rewards, group_ids, eps, unbiased)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, unbiased: bool = True
) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j in g, j != i} r_j. ``eps`` and ``unbiased`` unused.
    rewards [B], group_ids [B] -> advantages [B] f32; G = 1 -> 0 (there are no others)."""
    return _run_estimator("rloo", rewards, group_ids, eps, unbiased)


# ----------------------------------------------------------------------------------------
# front door
# ----------------------------------------------------------------------------------------


@dataclass
class AdvantageResult:
    """Advantages of one batch plus the group bookkeeping every later stage needs.

    advantages [B] f32; group_index [B] long (0..n_groups-1, order of first appearance);
    degenerate_groups [n_groups] bool (all rewards equal, incl. G = 1 -> advantages 0).
    """

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
    """Advantages over FULL groups (before any down-sampling), with degenerate-group report.

    rewards [B] real, group_ids [B] integer (arbitrary, unsorted ids; unequal group sizes
    allowed) -> :class:`AdvantageResult`. ``estimator`` is a name in
    :data:`ADVANTAGE_ESTIMATORS`. No collectives; memory O(B + n_groups).
    """
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
