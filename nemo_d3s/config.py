"""Typed configuration schema of a training run.

The dataclasses are registered in Hydra's ConfigStore and head ``conf/config.yaml``'s defaults, so
YAML and overrides merge INTO them: an unknown key or a wrong type fails at start-up naming it. The
``d3s`` group's options are the presets of ``core.presets.PRESETS`` (no YAML copies; a user's
``conf/d3s/<name>.yaml`` starts from the ``d3s`` preset). Each section checks its fields in
``validate()`` when built; :func:`validate` builds them all, then runs the cross-section checks, and
settings a lower layer owns are judged by building its object (GenerationConfig, DynamicSchedule,
VLLMEngineConfig). Errors are :class:`ConfigError` naming the dotted key. What the machine must
provide (vLLM, a GPU) is checked later by ``trainer.build.check_runtime``, so the dry run validates
GPU configs on a login node."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from nemo_d3s.config_d3s import D3SSection, ScheduleConfig
from nemo_d3s.config_schema import (
    AlgorithmConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
    TrainerConfig,
)
from nemo_d3s.core.checks import is_count
from nemo_d3s.config_section import Section, require
from nemo_d3s.core.presets import PRESETS
from nemo_d3s.errors import ConfigError  # re-exported: its home before errors.py

__all__ = [
    "AlgorithmConfig",
    "ConfigError",
    "D3SSection",
    "LoggingConfig",
    "ModelConfig",
    "RolloutConfig",
    "ScheduleConfig",
    "TaskConfig",
    "TrainConfig",
    "TrainerConfig",
    "register_configs",
    "validate",
    "validate_layout",
]

SEED_MAX = 2**32 - 1  # numpy's seed range; torch / Megatron add offsets to it that stay in int64


@dataclass
class TrainConfig(Section):
    """Root of the resolved config (``conf/config.yaml``); its own check spans sections."""

    output_dir: str = "outputs/run"  # conf/config.yaml: outputs/<date>_<time>
    resume: bool = False
    seed: int = 0  # in [0, 2**32 - 1]
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    d3s: D3SSection = field(default_factory=D3SSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: int = 1) -> None:
        """The sections' own checks, then what spans them (N against G, prompts over ranks)."""
        for f in fields(self):
            section = getattr(self, f.name)
            if isinstance(section, Section):
                section.validate()
        require(
            is_count(self.seed, 0) and self.seed <= SEED_MAX,
            "seed",
            self.seed,
            f"must be an integer in [0, {SEED_MAX}]",
        )
        require(bool(self.output_dir), "output_dir", self.output_dir, "must be a directory path")
        g = self.trainer.num_generations
        # an int N is a count of the G rollouts (fractions: the schedule's check)
        for name in ("n_init", "n_final"):
            n = getattr(self.d3s.schedule, name)
            require(
                not is_count(n, 0) or n <= g,
                f"d3s.schedule.{name}",
                n,
                "cannot keep more rollouts per prompt than are generated "
                f"(trainer.num_generations={g})",
            )
        try:  # pods keeping one rollout per prompt: every kept advantage is 0
            self.d3s.to_core().check_group_size(g)
        except ValueError as e:
            raise ConfigError(f"d3s.schedule.{e} (trainer.num_generations={g})") from None
        stale = int(self.rollout.max_staleness)
        require(
            not (
                stale > 0
                and self.rollout.engine == "hf"
                and self.model.params.get("sampler") == "hf_generate"
            ),
            "rollout.max_staleness",
            stale,
            "trains on rollouts of older weights, corrected by their behaviour log-probs, "
            "which model.params.sampler=hf_generate (transformers' generate, one seed per call "
            "and the process's RNG, from the rollout thread) does not return: use the seeded "
            "sampler (the default) or rollout=vllm",
        )
        validate_layout(self, world_size)


def register_configs() -> None:
    """Register the schema and every ``PRESETS`` entry as a ``d3s`` group option in Hydra's
    ConfigStore."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name in PRESETS:
        cs.store(group="d3s", name=name, node=D3SSection.from_preset(name))


# ---------------------------------------------------------------------------------------
# checking a composed config
# ---------------------------------------------------------------------------------------


def typed(cfg: Any) -> TrainConfig:
    """A composed config (DictConfig or TrainConfig) as the checked dataclasses. It is merged into a
    fresh schema first, so keys added with ``+key=value`` (bypassing the struct flag) fail too."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cfg, TrainConfig):
        return cfg
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"expected a DictConfig of TrainConfig, got {type(cfg).__name__}")
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not str(k).startswith("hydra"))
    if missing:
        raise ConfigError(
            f"{missing[0]}: required, but no value was given (set it with {missing[0]}=...)"
        )
    try:
        plain = {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in cfg.items()
            if k != "hydra"
        }
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), plain))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}" if key else str(e)) from None


def validate_layout(cfg: Any, dp_size: int) -> None:
    """The checks that need the policy's DP size: prompts shard in whole groups over the DP
    ranks."""
    ppp = cfg.trainer.prompts_per_step
    require(
        ppp % dp_size == 0,
        "trainer.prompts_per_step",
        ppp,
        f"must be divisible by the number of data-parallel ranks ({dp_size})",
    )


def validate(cfg: Any, world_size: int = 1) -> None:
    """Schema and range checks on a composed config or a :class:`TrainConfig`; ConfigError naming
    the first offending key. ``world_size``: DP ranks when known (the trainer calls
    :func:`validate_layout` with the real DP size once the policy is built)."""
    typed(cfg).validate(world_size)
