"""Rollout-level down-sampling: which of the B rollouts of a batch get a gradient.

What N means
------------
``n_keep`` (N) counts rollouts kept PER PROMPT (per group):

- an ``int`` >= 1 is a count; a group with fewer rollouts than N is kept whole;
- a ``float`` in (0, 1] is a fraction of the group size G, turned into a count by
  :func:`resolve_n_keep` (round half up, at least 1, at most G).

Per-group rules (``random``, ``max_reward``, ``pods``, ``d3s_intra``) keep
``resolve_n_keep(N, G_g)`` rollouts of every group g. The cross-group rule ``d3s_cross``
pools the whole batch and keeps ``sum_g resolve_n_keep(N, G_g)`` rollouts from the pool:
exactly as many as the intra-group rule would keep, i.e. N x n_groups when every group has
at least N rollouts, and never more than B. Kept rollouts of one prompt may then range from
0 to G.

Max-variance selection
----------------------
Choosing m of n values to maximise their variance is solved exactly by the lemma of PODS
(arXiv 2504.13818): with the values sorted, some optimal subset is the k largest plus the
m - k smallest for some k in 0..m. Scanning k with float64 prefix sums of v and v^2 costs
O(n log n) (the sort). See :func:`max_variance_subset`.

Determinism: the same inputs give the same indices (no atomics, stable sorts only). Ties are
broken as documented on :func:`max_variance_mask`; everywhere else ties go to the lower index.

This module is pure torch: no collectives. The distributed selector in
``nemo_d3s.distributed`` gathers what it needs and calls these functions.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

import torch

from nemo_d3s.core.advantages import (
    check_eps,
    check_group_ids,
    check_rewards,
    grouped_advantages,
    group_buckets,
    group_index,
    group_sizes,
)
from nemo_d3s.core.checks import check_bool, check_finite, check_same_device, check_shape, is_real
from nemo_d3s.core.max_variance import max_variance_mask, max_variance_subset
from nemo_d3s.core.registry import Registry

__all__ = [
    "SAMPLE_SELECTORS",
    "SampleRule",
    "SelectionInputs",
    "SampleSelection",
    "select_samples",
    "max_variance_subset",
    "max_variance_mask",
    "resolve_n_keep",
    "kept_advantage_variance",
    "share_nonzero_advantage",
    "PODS_EPS",
]

Count = Union[int, float]

#: The PODS paper's std offset in its re-normalisation a = (r - mean_S) / (std_S + 1e-4).
PODS_EPS = 1e-4


class SampleRule(Protocol):
    """A sample selection rule: one checked :class:`SelectionInputs` -> SampleSelection."""

    def __call__(self, x: SelectionInputs) -> SampleSelection: ...


SAMPLE_SELECTORS: Registry = Registry(
    "sample selection rule",
    SampleRule,
    # keeps_all: the rule keeps every rollout (N is ignored: reported as 1.0).
    # pooled: the rule's choice for one group depends on the other groups of the batch (or
    # on positions in it), so under data parallelism it must see the whole DP batch.
    keeps_all=False,
    pooled=False,
)


@dataclass
class SampleSelection:
    """sample_keep [B] bool (True = the rollout is trained on); advantages [B] f32, equal to
    the input advantages except for ``pods``, which re-normalises the KEPT rows on the kept
    subset (dropped rows keep their input value; they carry no gradient anyway)."""

    sample_keep: torch.Tensor
    advantages: torch.Tensor
    n_kept: int

    @property
    def kept_rows(self) -> torch.Tensor:
        """[n_kept] long, ascending."""
        return self.sample_keep.nonzero().flatten()


# ----------------------------------------------------------------------------------------
# N
# ----------------------------------------------------------------------------------------


def _check_n_keep(n_keep: Count) -> None:
    if not is_real(n_keep):
        raise ValueError(
            f"n_keep must be an int >= 1 or a float fraction in (0, 1], got {n_keep!r}"
        )
    if isinstance(n_keep, numbers.Integral):
        if n_keep < 1:
            raise ValueError(f"n_keep must be >= 1 when given as an int count, got {n_keep!r}")
    elif not (0.0 < float(n_keep) <= 1.0):  # also rejects NaN
        raise ValueError(
            "n_keep must be in (0, 1] when given as a float fraction of the group size, "
            f"got {n_keep!r} (pass an int for an absolute count)"
        )


def resolve_n_keep(n_keep: Count, group_size: int) -> int:
    """Rollouts to keep from a group of ``group_size``.

    ``n_keep`` int >= 1: a count, capped at ``group_size`` (a small group is kept whole).
    ``n_keep`` float in (0, 1]: a fraction of ``group_size``, rounded half up, at least 1.
    """
    _check_n_keep(n_keep)
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, numbers.Integral)
        or group_size < 1
    ):
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if isinstance(n_keep, numbers.Integral):
        return int(min(int(n_keep), int(group_size)))
    # Half up rather than Python's half-to-even: 0.5 x 5 = 2.5 -> 3 reads as "half" better.
    return int(min(max(math.floor(float(n_keep) * group_size + 0.5), 1), group_size))


def _n_keep_per_group(n_keep: Count, sizes: torch.Tensor) -> torch.Tensor:
    """Vectorised :func:`resolve_n_keep`: sizes [n_groups] long -> counts [n_groups] long."""
    _check_n_keep(n_keep)
    if isinstance(n_keep, numbers.Integral):
        return sizes.clamp(max=int(n_keep))
    # float64 multiply + floor(x + 0.5) reproduces the Python float arithmetic exactly.
    m = torch.floor(sizes.to(torch.float64) * float(n_keep) + 0.5).to(torch.long)
    return torch.minimum(m.clamp(min=1), sizes)


# ----------------------------------------------------------------------------------------
# grouped helpers
# ----------------------------------------------------------------------------------------


def _rank_within_group(order: torch.Tensor, index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Position of every sample in its group when samples are visited in ``order``.

    order [B] long (a permutation), index [B] long dense group index -> rank [B] long.
    """
    # A stable sort by group on top of ``order`` keeps ``order``'s ranking inside each group.
    by_group = order[torch.sort(index[order], stable=True).indices]
    sizes = group_sizes(index, n_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(index)
    rank[by_group] = torch.arange(index.numel(), device=index.device) - starts[index[by_group]]
    return rank


_M1_TIE_RTOL = 1e-6  # relative: far above float32 advantages' rounding of the group mean


def _farthest_from_mean(values: torch.Tensor) -> torch.Tensor:
    """values [R, n] -> [R] long: per row, the column farthest from the row's mean (lower
    column on ties). The pick for N = 1, where every single value has variance 0."""
    vals = values.to(torch.float64)
    dev = (vals - vals.mean(dim=1, keepdim=True)).abs()
    # Deviations equal up to rounding (2 of 4 successes: +-0.87 around a mean that is 0 only
    # up to rounding) tie, and the lower index wins.
    near = dev >= dev.amax(dim=1, keepdim=True) * (1 - _M1_TIE_RTOL)
    return near.to(torch.int8).argmax(dim=1)  # the first True


def _grouped_max_variance(
    values: torch.Tensor, index: torch.Tensor, n_groups: int, n_keep: Count
) -> torch.Tensor:
    """Per-group max-variance selection: values [B], index [B] -> keep [B] bool.

    Groups of equal size are stacked into one [R, G] matrix and solved by one batched
    :func:`max_variance_mask` call (the usual case: every prompt has G rollouts). Unequal
    sizes cost one call per DISTINCT size (:func:`group_buckets`), never one per group.
    Layout columns are in ascending sample index, so the lower-index tie-break carries over.

    N = 1 (D3S-I's schedule starts at G/8 = 1 of 8): one value has no variance, so every
    choice ties and :func:`max_variance_mask`'s tie-break would keep each group's LOWEST
    value, i.e. train on negative advantages only (a D3S-I run collapsed that way: greedy
    eval 0.31 -> 0.00 in 5 steps). The project's reading: keep the value farthest from its
    group's mean (the largest |advantage|; lower index on ties), the single rollout whose
    advantage is largest in size, of either sign.
    """
    keep = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    for g_size, _, layout in group_buckets(index, n_groups):
        m = resolve_n_keep(n_keep, g_size)
        if m >= g_size:
            keep[layout.flatten()] = True  # a group of <= N rollouts is kept whole
        elif m == 1:
            keep[layout.gather(1, _farthest_from_mean(values[layout]).unsqueeze(1)).flatten()] = (
                True
            )
        else:
            keep[layout[max_variance_mask(values[layout], m)]] = True
    return keep


def _grouped_top(
    score: torch.Tensor, index: torch.Tensor, n_groups: int, n_keep: Count
) -> torch.Tensor:
    """Keep the resolve_n_keep(N, G) highest ``score`` of every group; ties by lower index.
    score [B] -> keep [B] bool."""
    # Stable descending sort = highest first, lower index first among equal scores.
    order = torch.sort(score, descending=True, stable=True).indices
    rank = _rank_within_group(order, index, n_groups)
    return rank < _n_keep_per_group(n_keep, group_sizes(index, n_groups))[index]


# ----------------------------------------------------------------------------------------
# validation shared by the rules
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectionInputs:
    """What every sample selection rule is given, checked when built: rewards [B] real,
    advantages [B] real (computed on the full groups), group_ids [B] integer, n_keep = N per
    prompt (int count or float fraction of G); ``generator`` (random rules), ``eps`` and
    ``unbiased`` (rules that re-normalise advantages). ``index`` [B] long and ``n_groups``:
    the dense group numbering (``advantages.group_index``)."""

    rewards: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    n_keep: Count
    generator: Optional[torch.Generator] = None
    eps: Optional[float] = None
    unbiased: bool = True
    index: torch.Tensor = field(init=False, repr=False)
    n_groups: int = field(init=False)

    def __post_init__(self) -> None:
        check_rewards(self.rewards, "rewards")
        check_rewards(self.advantages, "advantages")
        check_group_ids(self.group_ids)
        check_shape("advantages", self.advantages, self.rewards.shape, "rewards")
        check_shape("group_ids", self.group_ids, self.rewards.shape, "rewards")
        check_same_device(
            rewards=self.rewards, advantages=self.advantages, group_ids=self.group_ids
        )
        _check_n_keep(self.n_keep)
        index, n_groups = group_index(self.group_ids)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "n_groups", n_groups)


def _result(keep: torch.Tensor, advantages: torch.Tensor) -> SampleSelection:
    return SampleSelection(
        sample_keep=keep, advantages=advantages.to(torch.float32).clone(), n_kept=int(keep.sum())
    )


# ----------------------------------------------------------------------------------------
# registered rules
# ----------------------------------------------------------------------------------------


@SAMPLE_SELECTORS.register("all", keeps_all=True)
def select_all(x: SelectionInputs) -> SampleSelection:
    """Plain GRPO: keep every rollout. [B] inputs -> SampleSelection; n_keep is validated but
    has no effect."""
    return _result(torch.ones_like(x.rewards, dtype=torch.bool), x.advantages)


@SAMPLE_SELECTORS.register("random", pooled=True)
def select_random(x: SelectionInputs) -> SampleSelection:
    """Uniformly random N of each group, without replacement (PODS's "random" = GRPO on m
    rollouts). [B] inputs -> SampleSelection. Draws B uniforms from ``generator`` (on the
    generator's device, then moved), so a seeded generator gives the same subset on any
    device; ``None`` uses torch's global RNG."""
    gen = x.generator
    gen_device = gen.device if gen is not None else torch.device("cpu")
    u = torch.rand(x.rewards.numel(), generator=gen, device=gen_device, dtype=torch.float64)
    u = u.to(x.rewards.device)
    # The N smallest uniforms of a group are a uniform N-subset of it.
    keep = _grouped_top(-u, x.index, x.n_groups, x.n_keep)
    return _result(keep, x.advantages)


@SAMPLE_SELECTORS.register("max_reward")
def select_max_reward(x: SelectionInputs) -> SampleSelection:
    """The N highest rewards of each group, ties by lower index (PODS's max-reward
    baseline). [B] inputs -> SampleSelection."""
    keep = _grouped_top(x.rewards.to(torch.float64), x.index, x.n_groups, x.n_keep)
    return _result(keep, x.advantages)


@SAMPLE_SELECTORS.register("pods")
def select_pods(x: SelectionInputs) -> SampleSelection:
    """PODS max-variance down-sampling: per group, the N rollouts whose REWARDS have maximal
    variance; then the kept rows' advantages are re-normalised on the kept subset,
    a = (r - mean_S) / (std_S + eps), with ``eps`` defaulting to the paper's 1e-4
    (:data:`PODS_EPS`) and the unbiased std (the official code's). An all-equal subset, or a
    subset of one rollout, gets 0. [B] inputs -> SampleSelection."""
    eps = PODS_EPS if x.eps is None else x.eps
    check_eps(eps)
    keep = _grouped_max_variance(x.rewards, x.index, x.n_groups, x.n_keep)
    kept = keep.nonzero().flatten()
    # Every group keeps >= 1 rollout, so the group numbering survives the restriction.
    sub_adv, _ = grouped_advantages(
        x.rewards[kept], x.index[kept], x.n_groups, "grpo", float(eps), bool(x.unbiased)
    )
    out = x.advantages.to(torch.float32).clone()
    out[kept] = sub_adv.to(torch.float32)
    return SampleSelection(sample_keep=keep, advantages=out, n_kept=int(kept.numel()))


@SAMPLE_SELECTORS.register("d3s_intra")
def select_d3s_intra(x: SelectionInputs) -> SampleSelection:
    """D3S-I: per group, the N rollouts whose (full-group) ADVANTAGES have maximal variance;
    advantages are NOT re-normalised. [B] inputs -> SampleSelection."""
    keep = _grouped_max_variance(x.advantages, x.index, x.n_groups, x.n_keep)
    return _result(keep, x.advantages)


@SAMPLE_SELECTORS.register("d3s_cross", pooled=True)
def select_d3s_cross(x: SelectionInputs) -> SampleSelection:
    """D3S (cross-group): pool the advantages of the whole batch and keep the
    ``sum_g resolve_n_keep(N, G_g)`` (= N x n_groups for groups of >= N rollouts; <= B)
    with maximal variance; advantages are NOT re-normalised. [B] inputs -> SampleSelection.
    One sort of B values.

    A pool that keeps one rollout in all (one prompt, N = 1) has no variance to maximise
    either; as for the per-group rules, the rollout farthest from the pool's mean (the
    largest |A|) is kept, not the tie-break's minimum."""
    adv = x.advantages
    m_total = int(_n_keep_per_group(x.n_keep, group_sizes(x.index, x.n_groups)).sum())
    if m_total == 1 and adv.numel() > 1:
        keep = torch.zeros(adv.numel(), dtype=torch.bool, device=adv.device)
        keep[_farthest_from_mean(adv.unsqueeze(0))[0]] = True
    else:
        keep = max_variance_mask(adv.unsqueeze(0), m_total)[0]
    return _result(keep, adv)


def select_samples(
    rule: str,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    n_keep: Count,
    **kw,
) -> SampleSelection:
    """Apply the sample selection rule ``rule`` (a name in :data:`SAMPLE_SELECTORS`).

    rewards [B] real, advantages [B] real (computed on the full groups), group_ids [B]
    integer, n_keep = N per prompt (int count or float fraction of G). Keyword arguments
    (``generator``, ``eps``, ``unbiased``) go to the rule, in its :class:`SelectionInputs`.
    No collectives.
    """
    fn = SAMPLE_SELECTORS.get(rule)
    return fn(SelectionInputs(rewards, advantages, group_ids, n_keep, **kw))


# ----------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------


def _check_kept(
    advantages: torch.Tensor, sample_keep: torch.Tensor, min_kept: int, why: str
) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
        shape = (
            tuple(advantages.shape)
            if isinstance(advantages, torch.Tensor)
            else type(advantages).__name__
        )
        raise ValueError(f"advantages must be a 1-D tensor [B], got {shape}")
    check_bool("sample_keep", sample_keep)
    check_shape("sample_keep", sample_keep, advantages.shape, "advantages")
    check_same_device(advantages=advantages, sample_keep=sample_keep)
    kept = advantages[sample_keep]
    check_finite("advantages", kept)
    if kept.numel() < min_kept:
        raise ValueError(f"sample_keep keeps {kept.numel()} sample(s); {why}")
    return kept.to(torch.float64)


def kept_advantage_variance(
    advantages: torch.Tensor, sample_keep: torch.Tensor, unbiased: bool = True
) -> float:
    """Variance of the kept advantages (the quantity D3S maximises; >= 1 for the paper's
    bound). advantages [B], sample_keep [B] bool -> float (float64 arithmetic).
    Needs >= 2 kept samples for the unbiased estimator, >= 1 for the population one."""
    need = 2 if unbiased else 1
    estimator = "unbiased" if unbiased else "population"
    kept = _check_kept(
        advantages, sample_keep, need, f"the {estimator} variance needs at least {need}"
    )
    return float(kept.var(correction=1 if unbiased else 0))


def share_nonzero_advantage(advantages: torch.Tensor, sample_keep: torch.Tensor) -> float:
    """Fraction of kept samples whose advantage is non-zero (degenerate groups give exact
    zeros). advantages [B], sample_keep [B] bool -> float in [0, 1]; needs >= 1 kept sample."""
    kept = _check_kept(
        advantages, sample_keep, 1, "the share of non-zero advantages needs at least 1"
    )
    return float((kept != 0).to(torch.float64).mean())
