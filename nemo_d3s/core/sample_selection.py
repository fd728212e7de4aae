"""Rollout-level down-sampling: which of the B rollouts of a batch get a gradient.

N (``n_keep``) counts rollouts per prompt: an int >= 1, or a float in (0, 1] of the group size
(:func:`resolve_n_keep`). Per-group rules keep ``resolve_n_keep(N, G_g)`` of every group;
``d3s_cross`` keeps ``sum_g resolve_n_keep(N, G_g)`` (<= B) from the pooled batch. Max-variance
subsets use the PODS lemma (arXiv 2504.13818): some optimal m-subset of sorted values is the k
largest plus the m - k smallest (:func:`max_variance_subset`). Deterministic (stable sorts, no
atomics; ties to the lower index). Pure torch: ``nemo_d3s.distributed`` gathers, then calls it."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

import torch

from nemo_d3s.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    check_eps,
    check_group_ids,
    check_rewards,
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
    # renormalises: the rule recomputes the kept rollouts' advantages on the kept subset, so
    # a group keeping one rollout gives it advantage 0 (no policy gradient).
    renormalises=False,
)


@dataclass
class SampleSelection:
    """sample_keep [B] bool; advantages [B] f32, the input's except under ``pods``, which
    re-normalises the kept rows on the kept subset."""

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
    """Rollouts to keep from a group of ``group_size``: an int count (capped at the group size), or
    a float fraction rounded half up, at least 1."""
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
    """order [B] (a permutation), index [B] dense group index -> rank [B]: each sample's position in
    its group when visited in ``order``."""
    # A stable sort by group on top of ``order`` keeps ``order``'s ranking inside each group.
    by_group = order[torch.sort(index[order], stable=True).indices]
    sizes = group_sizes(index, n_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(index)
    rank[by_group] = torch.arange(index.numel(), device=index.device) - starts[index[by_group]]
    return rank


def _grouped_max_variance(
    values: torch.Tensor, index: torch.Tensor, n_groups: int, n_keep: Count
) -> torch.Tensor:
    """Per-group max-variance selection: values [B], index [B] -> keep [B] bool.

    Equal-size groups are solved as one batched [R, G] :func:`max_variance_mask` (one call per
    distinct size; N = 1 keeps the value farthest from its group's mean)."""
    keep = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    for g_size, _, layout in group_buckets(index, n_groups):
        m = resolve_n_keep(n_keep, g_size)
        if m >= g_size:
            keep[layout.flatten()] = True  # a group of <= N rollouts is kept whole
        else:
            keep[layout[max_variance_mask(values[layout], m)]] = True
    return keep


def _grouped_top(
    score: torch.Tensor, index: torch.Tensor, n_groups: int, n_keep: Count
) -> torch.Tensor:
    """score [B] -> keep [B]: the ``resolve_n_keep(N, G)`` highest of every group, ties to the lower
    index."""
    # Stable descending sort = highest first, lower index first among equal scores.
    order = torch.sort(score, descending=True, stable=True).indices
    rank = _rank_within_group(order, index, n_groups)
    return rank < _n_keep_per_group(n_keep, group_sizes(index, n_groups))[index]


# ----------------------------------------------------------------------------------------
# validation shared by the rules
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectionInputs:
    """What every sample rule is given, checked when built: rewards, advantages (full groups),
    group_ids [B]; N; ``generator``, ``eps``, ``unbiased``, ``advantage`` (the estimator PODS
    re-normalises the kept subset with) for the rules that use them; the dense ``index`` [B]
    and ``n_groups``."""

    rewards: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    n_keep: Count
    generator: Optional[torch.Generator] = None
    eps: Optional[float] = None
    unbiased: bool = True
    advantage: str = "grpo"
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
    """Plain GRPO: keep every rollout (N validated, unused)."""
    return _result(torch.ones_like(x.rewards, dtype=torch.bool), x.advantages)


@SAMPLE_SELECTORS.register("random", pooled=True)
def select_random(x: SelectionInputs) -> SampleSelection:
    """Uniformly random N of each group, without replacement. Draws B uniforms on the generator's
    device, so a seeded generator gives the same subset on any device."""
    gen = x.generator
    gen_device = gen.device if gen is not None else torch.device("cpu")
    u = torch.rand(x.rewards.numel(), generator=gen, device=gen_device, dtype=torch.float64)
    u = u.to(x.rewards.device)
    # The N smallest uniforms of a group are a uniform N-subset of it.
    keep = _grouped_top(-u, x.index, x.n_groups, x.n_keep)
    return _result(keep, x.advantages)


@SAMPLE_SELECTORS.register("max_reward")
def select_max_reward(x: SelectionInputs) -> SampleSelection:
    """The N highest rewards of each group, ties by lower index; full-group advantages (PODS's
    max-reward baseline, which trains GRPO on the subset, is ``pods_max_reward``)."""
    keep = _grouped_top(x.rewards.to(torch.float64), x.index, x.n_groups, x.n_keep)
    return _result(keep, x.advantages)


@SAMPLE_SELECTORS.register("pods", renormalises=True)
def select_pods(x: SelectionInputs) -> SampleSelection:
    """PODS: per group, the N rollouts whose rewards have maximal variance; kept advantages
    re-computed on the kept subset with the run's estimator (``advantage``; GRPO's
    (r - mean_S) / (std_S + eps) as the paper), eps default 1e-4 and unbiased std as the
    paper's code; a constant or single-rollout subset gets 0."""
    keep = _grouped_max_variance(x.rewards, x.index, x.n_groups, x.n_keep)
    return _renormalised(x, keep)


@SAMPLE_SELECTORS.register("pods_random", pooled=True, renormalises=True)
def select_pods_random(x: SelectionInputs) -> SampleSelection:
    """PODS's random baseline: ``random``'s subset, its advantages re-computed on it as
    ``pods`` does (GRPO on N rollouts a prompt)."""
    return _renormalised(x, select_random(x).sample_keep)


@SAMPLE_SELECTORS.register("pods_max_reward", renormalises=True)
def select_pods_max_reward(x: SelectionInputs) -> SampleSelection:
    """PODS's max-reward baseline: ``max_reward``'s subset, its advantages re-computed on it as
    ``pods`` does."""
    return _renormalised(x, select_max_reward(x).sample_keep)


def _renormalised(x: SelectionInputs, keep: torch.Tensor) -> SampleSelection:
    """``keep`` [B] with the kept rollouts' advantages re-computed on the kept subset (the run's
    estimator, eps default ``PODS_EPS``)."""
    eps = PODS_EPS if x.eps is None else x.eps
    check_eps(eps)
    kept = keep.nonzero().flatten()
    # Every group keeps >= 1 rollout, so the group numbering survives the restriction.
    estimator = ADVANTAGE_ESTIMATORS.get(x.advantage)
    sub_adv = estimator(x.rewards[kept], x.index[kept], eps=float(eps), unbiased=bool(x.unbiased))
    out = x.advantages.to(torch.float32).clone()
    out[kept] = sub_adv.to(torch.float32)
    return SampleSelection(sample_keep=keep, advantages=out, n_kept=int(kept.numel()))


@SAMPLE_SELECTORS.register("d3s_intra")
def select_d3s_intra(x: SelectionInputs) -> SampleSelection:
    """D3S-I: per group, the N rollouts whose full-group advantages have maximal variance; no
    re-normalisation."""
    keep = _grouped_max_variance(x.advantages, x.index, x.n_groups, x.n_keep)
    return _result(keep, x.advantages)


@SAMPLE_SELECTORS.register("d3s_cross", pooled=True)
def select_d3s_cross(x: SelectionInputs) -> SampleSelection:
    """D3S: the ``sum_g resolve_n_keep(N, G_g)`` pooled advantages of maximal variance
    (one sort of B values); no re-normalisation. A pool keeping one rollout keeps the largest
    |A|."""
    adv = x.advantages
    m_total = int(_n_keep_per_group(x.n_keep, group_sizes(x.index, x.n_groups)).sum())
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
    """Apply the ``SAMPLE_SELECTORS`` rule ``rule``: rewards, advantages (full groups), group_ids
    [B], N -> SampleSelection; keywords go to the rule's :class:`SelectionInputs`."""
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
    """Variance (float64) of the kept advantages, which D3S maximises; advantages [B], sample_keep
    [B] -> float. Needs >= 2 kept samples when unbiased, >= 1 otherwise."""
    need = 2 if unbiased else 1
    estimator = "unbiased" if unbiased else "population"
    kept = _check_kept(
        advantages, sample_keep, need, f"the {estimator} variance needs at least {need}"
    )
    return float(kept.var(correction=1 if unbiased else 0))


def share_nonzero_advantage(advantages: torch.Tensor, sample_keep: torch.Tensor) -> float:
    """Fraction of kept samples with a non-zero advantage; needs >= 1 kept sample."""
    kept = _check_kept(
        advantages, sample_keep, 1, "the share of non-zero advantages needs at least 1"
    )
    return float((kept != 0).to(torch.float64).mean())
