"""D3S / PODS configurations: :class:`D3SConfig` and the papers' named ``PRESETS``, the one home of
these values (the training config's ``d3s`` group and its defaults are built from it).

=========  ============  ==========  ==========================================
preset     sample rule   tokens      schedule
=========  ============  ==========  ==========================================
grpo       all           all         none: train on everything
pods       pods          all         fixed N (re-normalises advantages on subset)
d1s        d3s_intra     all         fixed N
d1s_cross  d3s_cross     all         fixed N
d2s        d3s_cross     batch       fixed N, fixed K
d3s        d3s_cross     batch       linear N 1/8 -> 1/2 of G, K 5% -> 20%,
                                     at least 256 tokens a step
d3s_i      d3s_intra     batch       as d3s, intra-group selection
=========  ============  ==========  ==========================================

N is a fraction of G so presets work at any G: the D3S paper's N 8 -> 32 read as G = 64
(an assumption), PODS's n ~ 4 m as 1/4. The 256-token floor (``min_kept_tokens``; 0 is the papers'
rule) binds only on small batches, where 5% kept ~10 tokens a step (docs/evidence.md). PODS's loss
is ``d3s=pods algorithm.aggregation=seq_mean_token_mean``."""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

from nemo_d3s.core.checks import is_count, is_integer
from nemo_d3s.core.advantages import ADVANTAGE_ESTIMATORS
from nemo_d3s.core.sample_selection import SAMPLE_SELECTORS, resolve_n_keep
from nemo_d3s.core.schedules import DynamicSchedule
from nemo_d3s.core.token_selection import TOKEN_SELECTORS

__all__ = ["D3SConfig", "PRESETS", "DEFAULT_MIN_KEPT_TOKENS"]

Count = Union[int, float]


def _check_nonneg(name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")


@dataclass
class D3SConfig:
    """What the selector does: rules, scope and a ``schedule`` of N (int count or fraction of G) and
    K over progress. Usable as a structured Hydra config; names are checked against the registries
    at construction (ValueError listing the known ones)."""

    advantage: str = "grpo"  # ADVANTAGE_ESTIMATORS
    sample_rule: str = "all"  # SAMPLE_SELECTORS
    token_scope: str = "all"  # TOKEN_SELECTORS
    schedule: DynamicSchedule = field(
        default_factory=lambda: DynamicSchedule("constant", 1.0, 1.0, 1.0, 1.0)
    )
    eps: float = 1e-6  # advantage std offset (GRPO)
    unbiased: bool = True
    # Offset of the PODS re-normalisation on the kept subset; None = the rule's default
    # (1e-4, the PODS paper's value).
    renorm_eps: Optional[float] = None
    seed: int = 0  # only the "random" rule draws; seeded per step for reproducibility
    # Floor on the tokens a step keeps (token scopes that score tokens only): K is raised to
    # max(K, M / eligible tokens of the whole step), so a small batch is not cut to a
    # handful of tokens. 0 = off (the papers' rule). Inert once K x eligible >= M, e.g. at
    # the papers' batch sizes; see ``token_selection.k_frac_with_floor``.
    min_kept_tokens: int = 0
    # The tokens of kept rollouts whose advantage is 0 (an all-equal group under intra-group
    # selection; a pool with fewer non-zero advantages than N under cross-group): "keep" them
    # in the token pool (the papers' rule: they score 0, so they are kept last) or "drop"
    # them, so they neither fill K nor count in the ``kept`` loss normaliser (with
    # ``normalize_by=kept`` the gradient scale then does not depend on K) nor cost an update
    # pass. Their KL term goes with them.
    zero_advantage_tokens: str = "keep"

    def __post_init__(self) -> None:
        if isinstance(self.schedule, Mapping):  # plain dict / DictConfig from a config file
            try:
                self.schedule = DynamicSchedule(**dict(self.schedule))
            except TypeError as e:
                raise ValueError(f"schedule: {e}") from None
        if not isinstance(self.schedule, DynamicSchedule):
            raise ValueError(
                "schedule must be a DynamicSchedule or a mapping of its fields, got "
                f"{self.schedule!r}"
            )
        ADVANTAGE_ESTIMATORS.get(self.advantage)
        SAMPLE_SELECTORS.get(self.sample_rule)
        TOKEN_SELECTORS.get(self.token_scope)
        _check_nonneg("eps", self.eps)
        if self.renorm_eps is not None:
            _check_nonneg("renorm_eps", self.renorm_eps)
        if not isinstance(self.unbiased, bool):
            raise ValueError(f"unbiased must be a bool, got {self.unbiased!r}")
        if not is_integer(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        zat = self.zero_advantage_tokens
        if zat not in ("keep", "drop"):
            raise ValueError(f"zero_advantage_tokens must be 'keep' or 'drop', got {zat!r}")
        m = self.min_kept_tokens
        if not is_count(m):
            raise ValueError(f"min_kept_tokens must be an int >= 0 (0 = no floor), got {m!r}")

    def check_group_size(self, group_size: int) -> None:
        """ValueError, naming the schedule's endpoint, when a rule that re-normalises on the kept
        subset (``pods``) would keep fewer than 2 of ``group_size`` rollouts per prompt: one
        rollout's re-normalised advantage is 0, so such a step learns nothing. N stays between its
        values at p = 0 and p = 1 (every schedule interpolates or steps between them; ``constant``
        keeps n_init) and ``resolve_n_keep`` is monotone in N, so checking both ends covers the
        run."""
        if not SAMPLE_SELECTORS.prop(self.sample_rule, "renormalises"):
            return
        for name, p in (("n_init", 0.0), ("n_final", 1.0)):
            n = self.schedule.at(p)[0]
            m = resolve_n_keep(n, group_size)
            if m < 2:
                raise ValueError(
                    f"{name}={n!r} keeps {m} of the {group_size} rollouts per prompt, and "
                    f"sample_rule={self.sample_rule!r} re-normalises the kept advantages, which "
                    "for one rollout is 0: nothing would be learned; keep at least 2 (an int "
                    "count >= 2, a fraction with N x G >= 1.5, or more generations per prompt)"
                )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "D3SConfig":
        """A fresh copy of ``PRESETS[name]`` with ``overrides`` (field=value) applied."""
        if name not in PRESETS:
            raise ValueError(f"unknown D3S preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return cls._replace(copy.deepcopy(PRESETS[name]), overrides)

    @classmethod
    def from_mapping(cls, values: Mapping) -> "D3SConfig":
        """From a dict / DictConfig with (a subset of) the fields; ``schedule`` may be a mapping."""
        return cls._replace(cls(), dict(values))

    @staticmethod
    def _replace(cfg: "D3SConfig", overrides: Dict[str, Any]) -> "D3SConfig":
        known = [f.name for f in dataclasses.fields(D3SConfig)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(f"unknown D3SConfig field(s) {unknown}; known: {', '.join(known)}")
        return dataclasses.replace(cfg, **overrides)


def _fixed(n: Count, k: float) -> DynamicSchedule:
    return DynamicSchedule("constant", n, n, k, k)


# The full methods' floor on kept tokens per step (see the module docstring).
DEFAULT_MIN_KEPT_TOKENS = 256

PRESETS: Dict[str, D3SConfig] = {
    "grpo": D3SConfig(),
    "pods": D3SConfig(sample_rule="pods", schedule=_fixed(0.25, 1.0)),
    "d1s": D3SConfig(sample_rule="d3s_intra", schedule=_fixed(0.25, 1.0)),
    "d1s_cross": D3SConfig(sample_rule="d3s_cross", schedule=_fixed(0.25, 1.0)),
    "d2s": D3SConfig(sample_rule="d3s_cross", token_scope="batch", schedule=_fixed(0.25, 0.2)),
    "d3s": D3SConfig(
        sample_rule="d3s_cross",
        token_scope="batch",
        schedule=DynamicSchedule("linear", 0.125, 0.5, 0.05, 0.2),
        min_kept_tokens=DEFAULT_MIN_KEPT_TOKENS,
    ),
    "d3s_i": D3SConfig(
        sample_rule="d3s_intra",
        token_scope="batch",
        schedule=DynamicSchedule("linear", 0.125, 0.5, 0.05, 0.2),
        min_kept_tokens=DEFAULT_MIN_KEPT_TOKENS,
    ),
}
