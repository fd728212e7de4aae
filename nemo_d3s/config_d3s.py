"""The ``d3s`` section of the run's config schema: a preset of ``core.presets.PRESETS`` plus any
field changed on top, the (N, K) schedule as a subsection. Defaults are the ``d3s`` preset's;
``core.presets.D3SConfig`` and ``DynamicSchedule`` judge the values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Union

from nemo_d3s.core.checks import is_number
from nemo_d3s.config_section import Section, known
from nemo_d3s.core.presets import PRESETS, D3SConfig
from nemo_d3s.core.sample_selection import SAMPLE_SELECTORS
from nemo_d3s.core.schedules import SCHEDULES, DynamicSchedule
from nemo_d3s.core.token_selection import TOKEN_SELECTORS
from nemo_d3s.distributed.topk import DISTRIBUTED_TOKEN_SCOPES
from nemo_d3s.errors import ConfigError

__all__ = ["DEFAULT_PRESET", "D3SSection", "ScheduleConfig"]

Count = Union[int, float]
DEFAULT_PRESET = "d3s"


@dataclass
class ScheduleConfig(Section):
    """(N, K) over progress p in [0, 1]: N per prompt (int count or fraction of G), K the fraction
    of eligible tokens kept. ``DynamicSchedule`` judges the values; N against G is checked by
    :class:`TrainConfig`."""

    KEY: ClassVar[str] = "d3s.schedule"
    kind: str = "constant"  # core.schedules.SCHEDULES: linear | cosine | constant | step
    n_init: Count = 1.0
    n_final: Count = 1.0
    k_init: float = 1.0
    k_final: float = 1.0
    # kind=step only: the progress values where (N, K) steps; empty = the core default (0.5)
    milestones: List[float] = field(default_factory=list)

    @classmethod
    def of(cls, s: DynamicSchedule) -> "ScheduleConfig":
        return cls(
            s.kind, s.n_init, s.n_final, s.k_init, s.k_final, list(s.kwargs.get("milestones", []))
        )

    def to_core(self) -> DynamicSchedule:
        kw = (
            {"milestones": [float(m) for m in self.milestones]}
            if self.kind == "step" and len(self.milestones)
            else {}
        )
        return DynamicSchedule(self.kind, self.n_init, self.n_final, self.k_init, self.k_final, kw)

    def validate(self) -> None:
        known(f"{self.KEY}.kind", self.kind, SCHEDULES)
        ms = list(self.milestones)
        self._check(
            all(is_number(m) and 0 <= m <= 1 for m in ms), "milestones", "progress values in [0, 1]"
        )
        # (it was dropped without a word for another kind)
        self._check(not ms or self.kind == "step", "milestones", "only kind=step has milestones")
        self._built(self.to_core)


def _preset_fields(name: str) -> Dict[str, Any]:
    """The fields of :class:`D3SSection` that ``core.presets.PRESETS[name]`` sets."""
    p: D3SConfig = PRESETS[name]
    return {
        "preset": name,
        "sample_rule": p.sample_rule,
        "token_scope": p.token_scope,
        "schedule": ScheduleConfig.of(p.schedule),
        "eps": p.eps,
        "unbiased": p.unbiased,
        "min_kept_tokens": p.min_kept_tokens,
    }


_DEFAULT = _preset_fields(DEFAULT_PRESET)


@dataclass
class D3SSection(Section):
    """Sample/token down-sampling: a preset (``d3s=<preset>``) plus fields changed on top
    (``d3s.schedule.k_init=0.1``); ``--cfg job`` prints every value that runs. :meth:`to_core`
    builds the ``D3SConfig`` that judges them."""

    KEY: ClassVar[str] = "d3s"
    preset: str = DEFAULT_PRESET
    sample_rule: str = _DEFAULT["sample_rule"]
    token_scope: str = _DEFAULT["token_scope"]
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig.of(PRESETS[DEFAULT_PRESET].schedule)
    )
    eps: float = _DEFAULT["eps"]
    unbiased: bool = _DEFAULT["unbiased"]
    # the offset of a re-normalising rule's (pods, pods_random, pods_max_reward) advantages on
    # the kept subset; null: the PODS paper's 1e-4
    renorm_eps: Optional[float] = None
    # At least this many tokens per optimizer step (K raised to M / eligible tokens when
    # K x eligible is smaller); 0 = no floor. core.presets.D3SConfig.min_kept_tokens.
    min_kept_tokens: int = _DEFAULT["min_kept_tokens"]
    # token_scope=batch under data parallelism: global_exact (the top K% of the whole DP
    # batch), local (per rank, like most frameworks) or gather_quantile (approximate).
    dp_batch_scope: str = "global_exact"
    # keep | drop the tokens of kept rollouts whose advantage is 0 from the token pool
    # (core.presets.D3SConfig.zero_advantage_tokens)
    zero_advantage_tokens: str = "keep"

    @classmethod
    def from_preset(cls, name: str) -> "D3SSection":
        """The section of ``core.presets.PRESETS[name]`` (what ``d3s=<name>`` selects)."""
        if name not in PRESETS:
            raise ConfigError(f"d3s={name!r}: unknown preset; known: {', '.join(sorted(PRESETS))}")
        return cls(**_preset_fields(name))

    def to_core(self, advantage: str = "grpo", seed: int = 0) -> D3SConfig:
        """The core :class:`D3SConfig` (+ the run's advantage estimator and seed)."""
        return D3SConfig(
            advantage=advantage,
            sample_rule=self.sample_rule,
            token_scope=self.token_scope,
            schedule=self.schedule.to_core(),
            eps=self.eps,
            unbiased=self.unbiased,
            renorm_eps=self.renorm_eps,
            min_kept_tokens=self.min_kept_tokens,
            zero_advantage_tokens=self.zero_advantage_tokens,
            seed=seed,
        )

    def validate(self) -> None:
        known(f"{self.KEY}.sample_rule", self.sample_rule, SAMPLE_SELECTORS)
        known(f"{self.KEY}.token_scope", self.token_scope, TOKEN_SELECTORS)
        known(f"{self.KEY}.dp_batch_scope", self.dp_batch_scope, DISTRIBUTED_TOKEN_SCOPES)
        if not isinstance(self.schedule, ScheduleConfig):  # a plain mapping, built in Python
            self.schedule = ScheduleConfig(**dict(self.schedule))
        self._built(self.to_core)  # eps, min_kept_tokens, the schedule: D3SConfig's own checks
