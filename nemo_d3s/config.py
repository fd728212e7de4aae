"""Typed configuration schema of a training run.

The dataclasses below are registered in Hydra's ConfigStore (``register_configs``) and are
the first entry of ``conf/config.yaml``'s defaults list, so every YAML file and every
command-line override is merged INTO them: an unknown key fails at start-up with a message
naming it (``Key 'foo' not in 'TrainerConfig'``), and a value of the wrong type fails
likewise.

One source per setting:

- The D3S presets are ``core.presets.PRESETS``; :func:`register_configs` registers each one as
  an option of the ``d3s`` config group (``d3s=pods``), built by
  :meth:`D3SSection.from_preset`, and the schema's own ``d3s`` defaults are the ``d3s``
  preset's. There are no preset YAML files to keep equal to them (a user may still add
  ``conf/d3s/<name>.yaml``: Hydra offers both; fields it leaves out keep the ``d3s``
  preset's values).
- Each section checks its own fields in ``validate()``, beside the fields (like verl's
  rollout config), and ``__post_init__`` runs it, so a section built in Python is checked
  where it is built. :func:`validate` checks a composed config by turning it into these
  dataclasses (``OmegaConf.to_object`` builds every section, running its check), then runs
  the checks that span sections. Settings that an object of a lower layer owns are judged
  by building that object (sampling: ``backends.base.GenerationConfig``; the (N, K)
  schedule: ``core.schedules.DynamicSchedule``; vLLM's: ``VLLMEngineConfig``), so each rule
  is written once. A failed check raises :class:`ConfigError` naming the dotted key.
- What this machine must provide (vLLM installed, a GPU for ``model.device=cuda``) is
  checked by ``trainer.build.check_runtime`` before any model loads, not here: the dry run
  validates configs of GPU jobs on a login node.

The same dataclasses are used without Hydra (tests, notebooks):
``cfg = OmegaConf.structured(TrainConfig)``; ``validate(cfg)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, List, Optional, Union

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.vllm.config import VLLMEngineConfig
from nemo_d3s.config_section import Section, is_count, is_number, known, require
from nemo_d3s.core.presets import PRESETS, D3SConfig
from nemo_d3s.core.schedules import DynamicSchedule
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

Count = Union[int, float]
DEFAULT_PRESET = "d3s"
SEED_MAX = 2**32 - 1  # numpy's seed range; torch / Megatron add offsets to it that stay in int64


@dataclass
class AlgorithmConfig(Section):
    """The policy objective (``conf/algorithm/{grpo,gspo}.yaml``)."""

    KEY: ClassVar[str] = "algorithm"
    loss: str = "grpo"  # core.losses.POLICY_LOSSES: grpo | gspo | gspo_token
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: Optional[float] = None
    kl_coef: float = 0.0  # > 0 loads a frozen reference model
    aggregation: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum
    # What the loss is normalised by once tokens are selected (an open choice of D3S):
    # "kept" = the selected tokens (gradient scale independent of K), "eligible" = all
    # response tokens of the sample-selected rollouts (unselected tokens count as zeros).
    normalize_by: str = "kept"
    advantage: str = "grpo"  # core.advantages.ADVANTAGE_ESTIMATORS: grpo | dr_grpo | rloo
    # Truncated importance sampling against the rollout engine's own log-probs (vLLM): each
    # token's loss is weighted by min(pi_train_old / pi_engine, tis_cap). null = off.
    tis_cap: Optional[float] = None

    def validate(self) -> None:
        known(f"{self.KEY}.loss", self.loss, "nemo_d3s.core.losses", "POLICY_LOSSES")
        known(
            f"{self.KEY}.advantage",
            self.advantage,
            "nemo_d3s.core.advantages",
            "ADVANTAGE_ESTIMATORS",
        )
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
            self._check(
                is_number(getattr(self, name)) and getattr(self, name) >= 0, name, "must be >= 0"
            )
        dc = self.dual_clip_c
        self._check(dc is None or (is_number(dc) and dc > 1), "dual_clip_c", "must be > 1 or null")
        aggs = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
        self._check(self.aggregation in aggs, "aggregation", f"known: {', '.join(aggs)}")
        self._check(
            self.normalize_by in ("kept", "eligible"), "normalize_by", "known: kept, eligible"
        )
        tis = self.tis_cap
        self._check(
            tis is None or (is_number(tis) and tis >= 1),
            "tis_cap",
            "the importance-weight cap must be >= 1 (or null for off)",
        )


@dataclass
class ScheduleConfig(Section):
    """(N, K) as a function of progress p in [0, 1]: N per prompt (int count or fraction of
    G in (0, 1]), K = fraction of eligible tokens kept, in (0, 1]. The core
    :class:`DynamicSchedule` judges every value and the combination (e.g. an int n_init
    with a float n_final); N against G is checked by :class:`TrainConfig`."""

    KEY: ClassVar[str] = "d3s.schedule"
    kind: str = "constant"  # core.schedules.SCHEDULES: linear | cosine | constant | step
    n_init: Count = 1.0
    n_final: Count = 1.0
    k_init: float = 1.0
    k_final: float = 1.0
    milestones: List[float] = field(default_factory=list)  # only for kind=step

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
        known(f"{self.KEY}.kind", self.kind, "nemo_d3s.core.schedules", "SCHEDULES")
        ms = list(self.milestones)
        self._check(
            all(is_number(m) and 0 <= m <= 1 for m in ms), "milestones", "progress values in [0, 1]"
        )
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
    """Sample/token down-sampling: a preset of ``core.presets.PRESETS`` (``d3s=<preset>``, see
    :func:`register_configs`) and any field changed on top (``d3s.schedule.k_init=0.1``).
    The defaults are the ``d3s`` preset's; ``--cfg job`` prints every value that runs.
    ``core.presets.D3SConfig`` (built by :meth:`to_core`) judges the values."""

    KEY: ClassVar[str] = "d3s"
    preset: str = DEFAULT_PRESET
    sample_rule: str = _DEFAULT["sample_rule"]
    token_scope: str = _DEFAULT["token_scope"]
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig.of(PRESETS[DEFAULT_PRESET].schedule)
    )
    eps: float = _DEFAULT["eps"]
    unbiased: bool = _DEFAULT["unbiased"]
    # At least this many tokens per optimizer step (K raised to M / eligible tokens when
    # K x eligible is smaller); 0 = no floor. core.presets.D3SConfig.min_kept_tokens.
    min_kept_tokens: int = _DEFAULT["min_kept_tokens"]
    # token_scope=batch under data parallelism: global_exact (the top K% of the whole DP
    # batch), local (per rank, like most frameworks) or gather_quantile (approximate).
    dp_batch_scope: str = "global_exact"

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
            min_kept_tokens=self.min_kept_tokens,
            seed=seed,
        )

    def validate(self) -> None:
        known(
            f"{self.KEY}.sample_rule",
            self.sample_rule,
            "nemo_d3s.core.sample_selection",
            "SAMPLE_SELECTORS",
        )
        known(
            f"{self.KEY}.token_scope",
            self.token_scope,
            "nemo_d3s.core.token_selection",
            "TOKEN_SELECTORS",
        )
        known(
            f"{self.KEY}.dp_batch_scope",
            self.dp_batch_scope,
            "nemo_d3s.distributed.topk",
            "DISTRIBUTED_TOKEN_SCOPES",
        )
        if not isinstance(self.schedule, ScheduleConfig):  # a plain mapping, built in Python
            self.schedule = ScheduleConfig(**dict(self.schedule))
        self._built(self.to_core)  # eps, min_kept_tokens, the schedule: D3SConfig's own checks


@dataclass
class ModelConfig(Section):
    """The policy (``conf/model/*.yaml``). ``name`` is resolved by the backend: a registered
    short name (e.g. ``smollm2-135m-instruct``), a local Hugging Face folder or a GGUF file."""

    KEY: ClassVar[str] = "model"
    name: str = "smollm2-135m-instruct"
    backend: str = "hf"  # trainer.backend_registry: hf | megatron | "pkg.module:Class"
    dtype: str = "float32"
    device: str = "cpu"
    gradient_checkpointing: bool = False
    params: Dict[str, Any] = field(default_factory=dict)  # backend-specific extras

    def validate(self) -> None:
        import torch

        self._check(bool(self.name), "name", "must name a model")
        try:
            if self.device != "auto":  # auto: CUDA when there is a GPU (Megatron backend)
                torch.device(self.device)
        except (RuntimeError, TypeError):
            self._check(False, "device", "not a torch device (cpu, cuda, cuda:<index>, auto)")


@dataclass
class RolloutConfig(Section, VLLMEngineConfig):
    """Which engine samples the rollouts (``conf/rollout/{hf,vllm}.yaml``) and its settings.
    ``engine``: a name in ``backends.engines.ROLLOUT_ENGINES`` (hf = the policy's own model;
    vllm = vLLM in-process, refitted after every step). The other keys are vLLM's
    (:class:`~nemo_d3s.backends.vllm.config.VLLMEngineConfig`, which checks them); the hf
    engine has none."""

    KEY: ClassVar[str] = "rollout"
    engine: str = "hf"

    def validate(self) -> None:
        known(f"{self.KEY}.engine", self.engine, "nemo_d3s.backends.engines", "ROLLOUT_ENGINES")
        vllm_keys = {f.name: getattr(self, f.name) for f in fields(VLLMEngineConfig)}
        self._built(lambda: VLLMEngineConfig(**vllm_keys))


@dataclass
class TaskConfig(Section):
    """Prompts and verifiable reward (``conf/task/*.yaml``); ``params`` go to the task's
    constructor, which rejects keys it does not know."""

    KEY: ClassVar[str] = "task"
    name: str = "basic_arithmetic"
    params: Dict[str, Any] = field(default_factory=dict)
    eval_size: int = 64  # the first eval_size problems of the task's fixed held-out set
    # Upper bound on eval_size (each evaluation generates eval_size greedy completions): a
    # typo like eval_size=100000 fails at start instead of building 100k problems.
    max_eval_size: int = 10000
    # Prompts longer than the model can take (checked when the task loads): the limit is
    # max_prompt_tokens, or (null) the model's context length minus the new tokens of a
    # rollout/evaluation. long_prompts: "error" (stop, naming the problem) | "skip" (drop
    # them from training and evaluation, with a count).
    max_prompt_tokens: Optional[int] = None
    long_prompts: str = "error"

    def validate(self) -> None:
        self._check(is_count(self.eval_size, 1), "eval_size", "must be an integer >= 1")
        self._check(is_count(self.max_eval_size, 1), "max_eval_size", "must be an integer >= 1")
        self._check(
            self.eval_size <= self.max_eval_size,
            "eval_size",
            f"exceeds {self.KEY}.max_eval_size={self.max_eval_size} (every evaluation "
            "generates eval_size completions); raise task.max_eval_size if you mean it",
        )
        mpt = self.max_prompt_tokens
        self._check(
            mpt is None or is_count(mpt, 1),
            "max_prompt_tokens",
            "must be an integer >= 1 or null (the model's context length)",
        )
        self._check(self.long_prompts in ("error", "skip"), "long_prompts", "known: error, skip")


@dataclass
class TrainerConfig(Section):
    """Loop sizes, optimisation, evaluation and checkpoint cadence (``conf/trainer/``)."""

    KEY: ClassVar[str] = "trainer"
    steps: int = 30
    prompts_per_step: int = 8  # global, over all data-parallel ranks
    num_generations: int = 8  # G rollouts per prompt
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Only for a rollout engine WITHOUT per-prompt seeds (e.g. hf with model.params.sampler=
    # hf_generate): true = one generate call per prompt, seeded per prompt, so a prompt gets
    # the same samples on any rank layout; false = one batched call per rank and step,
    # several times faster on CPU, but a 2-rank run no longer equals a 1-rank run. An engine
    # with per-prompt seeds (the hf default) always samples in one batched call.
    generate_per_prompt: bool = True
    # Under data parallelism, move kept rollouts between ranks before each update so every
    # rank trains on about as many tokens (longest-first packing; the gradient is unchanged).
    dp_rebalance: bool = True
    # optimisation
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine (decay over the run, after warm-up)
    grad_clip: Optional[float] = 1.0
    num_mini_batches: int = 1  # optimizer steps per rollout batch
    micro_batch_size: int = 8
    logprob_micro_batch_size: int = 16
    # Token budgets instead of row counts (0 = the fixed sizes above): rows sorted by length
    # and packed while rows x longest row <= the budget (a longer row runs alone), so a
    # long-tailed batch does not pad every micro-batch to its longest response. Same
    # gradient (global denominators). logprob_micro_batch_tokens null = micro_batch_tokens.
    micro_batch_tokens: int = 0
    logprob_micro_batch_tokens: Optional[int] = None
    # evaluation (greedy decoding on task.eval_size held-out problems)
    eval_every: int = 10  # 0 = only at the end
    eval_at_start: bool = True
    eval_max_new_tokens: Optional[int] = None  # None = max_new_tokens
    eval_batch_size: int = 128
    # checkpoints
    save_every: int = 10  # 0 = only at the end
    keep_last: int = 2
    export_hf: bool = True  # DIR/hf_export at the end
    # resume=true refuses a config that changes the experiment (seed, model, algorithm,
    # d3s, task, rollout sampling, batch sizes, ...) unless this is true; the original
    # config.yaml is kept either way and the resumed one is written beside it.
    allow_config_change: bool = False
    # Stop with an error after this many consecutive steps in which every reward call
    # failed (a broken verifier); 0 = never stop.
    max_failed_reward_steps: int = 3
    # How long a collective waits for a stopped or dead peer rank before this rank exits
    # with an error (torch's default would be 30 minutes).
    dist_timeout_minutes: float = 10.0
    # Plan instead of train (nemo_d3s.dry_run): check the Megatron layout and print per-GPU
    # memory against gpu_memory_gb (decimal GB of one GPU); no weights, no process group.
    dry_run: bool = False
    gpu_memory_gb: float = 80.0
    nodes: Optional[int] = (
        None  # a recipe's cluster shape, nodes x gpus_per_node: the dry run's world
    )
    gpus_per_node: Optional[int] = (
        None  # unless NNODES / GPUS_PER_NODE or Slurm's say otherwise; None = 1 x 8
    )

    def generation(self) -> GenerationConfig:
        """The rollouts' sampling settings; GenerationConfig checks them (the one place
        temperature, top_p and top_k are judged)."""
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            do_sample=True,
        )

    def validate(self) -> None:
        self._check(
            is_count(self.num_generations, 2),
            "num_generations",
            "group advantages need >= 2 rollouts per prompt (G >= 2)",
        )
        for name in (
            "steps",
            "prompts_per_step",
            "max_new_tokens",
            "micro_batch_size",
            "logprob_micro_batch_size",
            "num_mini_batches",
            "eval_batch_size",
            "keep_last",
        ):
            self._check(is_count(getattr(self, name), 1), name, "must be an integer >= 1")
        for name in (
            "eval_every",
            "save_every",
            "warmup_steps",
            "top_k",
            "max_failed_reward_steps",
            "micro_batch_tokens",
        ):
            self._check(is_count(getattr(self, name), 0), name, "must be an integer >= 0")
        lmt = self.logprob_micro_batch_tokens
        self._check(
            lmt is None or is_count(lmt, 0),
            "logprob_micro_batch_tokens",
            "must be an integer >= 0 or null",
        )
        self._built(self.generation)
        self._check(is_number(self.lr) and self.lr > 0, "lr", "learning rate must be > 0")
        self._check(
            is_number(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0"
        )
        for name in ("adam_beta1", "adam_beta2"):
            self._check(
                is_number(getattr(self, name)) and 0 <= getattr(self, name) < 1,
                name,
                "must be in [0, 1)",
            )
        self._check(
            self.lr_schedule in ("constant", "linear", "cosine"),
            "lr_schedule",
            "known: constant, linear, cosine",
        )
        clip = self.grad_clip
        self._check(
            clip is None or (is_number(clip) and clip > 0), "grad_clip", "must be > 0 or null"
        )
        emt = self.eval_max_new_tokens
        self._check(
            emt is None or is_count(emt, 1),
            "eval_max_new_tokens",
            "must be an integer >= 1 or null",
        )
        self._check(
            self.num_mini_batches <= self.prompts_per_step,
            "num_mini_batches",
            f"cannot exceed {self.KEY}.prompts_per_step={self.prompts_per_step} "
            "(mini-batches are made of whole prompts)",
        )
        self._check(
            is_number(self.dist_timeout_minutes) and self.dist_timeout_minutes > 0,
            "dist_timeout_minutes",
            "must be > 0 (minutes)",
        )
        self._check(
            is_number(self.gpu_memory_gb) and self.gpu_memory_gb > 0, "gpu_memory_gb", "must be > 0"
        )


@dataclass
class LoggingConfig(Section):
    KEY: ClassVar[str] = "logging"
    progress_bar: bool = True
    tensorboard: bool = True  # used when the tensorboard package is importable
    level: str = (
        "INFO"  # DEBUG | INFO | WARNING | ERROR | CRITICAL (the nemo_d3s loggers on rank 0)
    )
    log_samples: int = 1  # completions printed at each evaluation (rank 0)

    def validate(self) -> None:
        levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
        self._check(self.level in levels, "level", f"unknown log level; known: {', '.join(levels)}")
        self._check(is_count(self.log_samples, 0), "log_samples", "must be an integer >= 0")


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
        for name in (
            "n_init",
            "n_final",
        ):  # an int N is a count of the G rollouts (fractions: the schedule's check)
            n = getattr(self.d3s.schedule, name)
            require(
                not is_count(n, 0) or n <= g,
                f"d3s.schedule.{name}",
                n,
                "cannot keep more rollouts per prompt than are generated "
                f"(trainer.num_generations={g})",
            )
        validate_layout(self, world_size)


def register_configs() -> None:
    """Register the schema (``train_schema``) and every preset of ``core.presets.PRESETS`` as an
    option of the ``d3s`` group in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name in PRESETS:
        cs.store(group="d3s", name=name, node=D3SSection.from_preset(name))


# ---------------------------------------------------------------------------------------
# checking a composed config
# ---------------------------------------------------------------------------------------


def typed(cfg: Any) -> TrainConfig:
    """A composed config (DictConfig, or a TrainConfig) as the dataclasses, every section
    checked. Unknown keys and wrong types fail even when added with Hydra's ``+key=value``
    (which bypasses the struct flag): the config is merged into a fresh schema first."""
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
    """The checks that need the parallel layout the policy built (``dp_size`` data-parallel
    ranks): prompts are sharded in whole groups over the DP ranks."""
    ppp = cfg.trainer.prompts_per_step
    require(
        ppp % dp_size == 0,
        "trainer.prompts_per_step",
        ppp,
        f"must be divisible by the number of data-parallel ranks ({dp_size})",
    )


def validate(cfg: Any, world_size: int = 1) -> None:
    """Schema and range checks on a composed config (DictConfig) or a :class:`TrainConfig`.
    Raises :class:`ConfigError` naming the first offending key. ``world_size``:
    data-parallel ranks when already known (the trainer validates before building the policy
    and calls :func:`validate_layout` with the real DP size after)."""
    typed(cfg).validate(world_size)
