"""Typed configuration schema of a training run.

The dataclasses below are registered in Hydra's ConfigStore (``register_configs``) and are
the first entry of ``conf/config.yaml``'s defaults list, so every YAML file and every
command-line override is merged INTO them: an unknown key fails at start-up with a message
naming it (``Key 'foo' not in 'TrainerConfig'``), and a value of the wrong type fails
likewise. Range checks that a type cannot express live in :func:`validate`, which raises
:class:`ConfigError` naming the dotted key and the offending value.

The same dataclasses are used without Hydra (tests, notebooks):
``cfg = OmegaConf.structured(TrainConfig)``; ``validate(cfg)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from nemo_d3s.backends.vllm.config import VLLMEngineConfig
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


@dataclass
class AlgorithmConfig:
    """The policy objective (``conf/algorithm/{grpo,gspo}.yaml``)."""

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


@dataclass
class ScheduleConfig:
    """(N, K) as a function of progress p in [0, 1]: N per prompt (int count or fraction of
    G in (0, 1]), K = fraction of eligible tokens kept, in (0, 1]."""

    kind: str = "constant"  # core.schedules.SCHEDULES: linear | cosine | constant | step
    n_init: Count = 1.0
    n_final: Count = 1.0
    k_init: float = 1.0
    k_final: float = 1.0
    milestones: List[float] = field(default_factory=list)  # only for kind=step


@dataclass
class D3SSection:
    """Sample/token down-sampling (``conf/d3s/<preset>.yaml``). Each preset file spells out
    every field, so ``--cfg job`` shows exactly what runs; tests check that the files agree
    with ``core.d3s.PRESETS``."""

    preset: str = "d3s"
    sample_rule: str = "d3s_cross"
    token_scope: str = "batch"
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig("linear", 0.125, 0.5, 0.05, 0.2)
    )
    eps: float = 1e-6
    unbiased: bool = True
    # At least this many tokens per optimizer step (K raised to M / eligible tokens when
    # K x eligible is smaller); 0 = no floor. core.d3s.D3SConfig.min_kept_tokens.
    min_kept_tokens: int = 256
    # token_scope=batch under data parallelism: global_exact (the top K% of the whole DP
    # batch), local (per rank, like most frameworks) or gather_quantile (approximate).
    dp_batch_scope: str = "global_exact"


@dataclass
class ModelConfig:
    """The policy (``conf/model/*.yaml``). ``name`` is resolved by the backend: a registered
    short name (e.g. ``smollm2-135m-instruct``), a local Hugging Face folder or a GGUF file."""

    name: str = "smollm2-135m-instruct"
    backend: str = "hf"  # trainer.backend_registry: hf | megatron | "pkg.module:Class"
    dtype: str = "float32"
    device: str = "cpu"
    gradient_checkpointing: bool = False
    params: Dict[str, Any] = field(default_factory=dict)  # backend-specific extras


@dataclass
class RolloutConfig(VLLMEngineConfig):
    """Which engine samples the rollouts (``conf/rollout/{hf,vllm}.yaml``) and its settings.
    ``engine``: a name in ``backends.engines.ROLLOUT_ENGINES`` (hf = the policy's own model;
    vllm = vLLM in-process, refitted after every step). The other keys are vLLM's
    (:class:`~nemo_d3s.backends.vllm.config.VLLMEngineConfig`); the hf engine has none."""

    engine: str = "hf"


@dataclass
class TaskConfig:
    """Prompts and verifiable reward (``conf/task/*.yaml``); ``params`` go to the task's
    constructor, which rejects keys it does not know."""

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


@dataclass
class TrainerConfig:
    """Loop sizes, optimisation, evaluation and checkpoint cadence (``conf/trainer/``)."""

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


@dataclass
class LoggingConfig:
    progress_bar: bool = True
    tensorboard: bool = True  # used when the tensorboard package is importable
    level: str = "INFO"
    log_samples: int = 1  # completions printed at each evaluation (rank 0)


@dataclass
class TrainConfig:
    """Root of the resolved config (``conf/config.yaml``)."""

    output_dir: str = "outputs/run"  # conf/config.yaml: outputs/<date>_<time>
    resume: bool = False
    seed: int = 0
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    d3s: D3SSection = field(default_factory=D3SSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register_configs() -> None:
    """Register the schema (``train_schema``) in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


# ---------------------------------------------------------------------------------------
# range validation
# ---------------------------------------------------------------------------------------


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_count(cfg: Any, key: str, group_size: int) -> None:
    """N: an int count in [1, G] or a float fraction of G in (0, 1]."""
    v = _get(cfg, key)
    _require(_number(v), key, v, "must be a number (an int count or a fraction of G in (0, 1])")
    if isinstance(v, int):
        _require(v >= 1, key, v, "rollouts kept per prompt must be >= 1")
        _require(
            v <= group_size, key, v,
            f"cannot keep more rollouts per prompt than are generated (trainer.num_generations={group_size})",
        )
    else:
        _require(0 < v <= 1, key, v, "a float N is a fraction of G and must be in (0, 1]; use an int for a count")


def _known(key: str, value: str, registry_path: str, attr: str) -> None:
    """Check ``value`` against a core registry (imported here, not at module load, so the
    schema module stays importable without torch)."""
    registry = getattr(__import__(registry_path, fromlist=[attr]), attr)
    if value not in registry:
        raise ConfigError(f"{key}={value!r}: unknown; known: {', '.join(registry.names())}")


def check_schema(cfg: Any) -> None:
    """Unknown keys and wrong types fail even when added with Hydra's ``+key=value``
    (which bypasses the struct flag): re-merge into a fresh schema."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, DictConfig):
        return
    try:
        plain = OmegaConf.to_container(cfg, resolve=False)
        plain.pop("hydra", None)
        OmegaConf.merge(OmegaConf.structured(TrainConfig), plain)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}" if key else str(e)) from None


def _check_schedule(cfg: Any) -> None:
    """Let the core schedule object judge the combination (e.g. an int n_init with a float n_final)."""
    from nemo_d3s.core.schedules import DynamicSchedule

    s = _get(cfg, "d3s.schedule")
    kw = {"milestones": list(s.milestones)} if s.kind == "step" and len(s.milestones) else {}
    try:
        DynamicSchedule(s.kind, s.n_init, s.n_final, s.k_init, s.k_final, kw)
    except ValueError as e:
        raise ConfigError(f"d3s.schedule: {e}") from None


def validate_layout(cfg: Any, dp_size: int) -> None:
    """The checks that need the parallel layout the policy built (``dp_size`` data-parallel
    ranks): prompts are sharded in whole groups over the DP ranks."""
    ppp = _get(cfg, "trainer.prompts_per_step")
    _require(ppp % dp_size == 0, "trainer.prompts_per_step", ppp,
             f"must be divisible by the number of data-parallel ranks ({dp_size})")


def validate(cfg: Any, world_size: int = 1) -> None:
    """Schema and range checks on a (resolved or structured) :class:`TrainConfig`. Raises
    :class:`ConfigError` naming the first offending key. ``world_size``: data-parallel ranks
    when already known (the trainer validates before building the policy and calls
    :func:`validate_layout` with the real DP size after)."""
    check_schema(cfg)
    t = "trainer"
    g = _get(cfg, f"{t}.num_generations")
    _require(
        isinstance(g, int) and g >= 2, f"{t}.num_generations", g,
        "group advantages need >= 2 rollouts per prompt (G >= 2)",
    )
    for key in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch_size",
                "logprob_micro_batch_size", "num_mini_batches", "eval_batch_size", "keep_last"):
        v = _get(cfg, f"{t}.{key}")
        _require(isinstance(v, int) and v >= 1, f"{t}.{key}", v, "must be an integer >= 1")
    for key in ("eval_every", "save_every", "warmup_steps", "top_k", "micro_batch_tokens"):
        v = _get(cfg, f"{t}.{key}")
        _require(isinstance(v, int) and v >= 0, f"{t}.{key}", v, "must be an integer >= 0")
    v = _get(cfg, f"{t}.logprob_micro_batch_tokens")
    _require(v is None or (isinstance(v, int) and v >= 0), f"{t}.logprob_micro_batch_tokens", v,
             "must be an integer >= 0 or null")
    lr = _get(cfg, f"{t}.lr")
    _require(_number(lr) and lr > 0, f"{t}.lr", lr, "learning rate must be > 0")
    wd = _get(cfg, f"{t}.weight_decay")
    _require(_number(wd) and wd >= 0, f"{t}.weight_decay", wd, "must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        v = _get(cfg, f"{t}.{key}")
        _require(_number(v) and 0 <= v < 1, f"{t}.{key}", v, "must be in [0, 1)")
    sched = _get(cfg, f"{t}.lr_schedule")
    _require(sched in ("constant", "linear", "cosine"), f"{t}.lr_schedule", sched, "known: constant, linear, cosine")
    temp = _get(cfg, f"{t}.temperature")
    _require(_number(temp) and temp > 0, f"{t}.temperature", temp, "must be > 0 (sampling needs it)")
    top_p = _get(cfg, f"{t}.top_p")
    _require(_number(top_p) and 0 < top_p <= 1, f"{t}.top_p", top_p, "must be in (0, 1]")
    clip = _get(cfg, f"{t}.grad_clip")
    _require(clip is None or (_number(clip) and clip > 0), f"{t}.grad_clip", clip, "must be > 0 or null")
    emt = _get(cfg, f"{t}.eval_max_new_tokens")
    _require(emt is None or (isinstance(emt, int) and emt >= 1), f"{t}.eval_max_new_tokens", emt,
             "must be an integer >= 1 or null")
    ppp = _get(cfg, f"{t}.prompts_per_step")
    nmb = _get(cfg, f"{t}.num_mini_batches")
    _require(nmb <= ppp, f"{t}.num_mini_batches", nmb,
             f"cannot exceed {t}.prompts_per_step={ppp} (mini-batches are made of whole prompts)")
    validate_layout(cfg, world_size)

    d = "d3s.schedule"
    for key in ("k_init", "k_final"):
        v = _get(cfg, f"{d}.{key}")
        _require(_number(v) and 0 < v <= 1, f"{d}.{key}", v, "K is a fraction of tokens and must be in (0, 1]")
    for key in ("n_init", "n_final"):
        _check_count(cfg, f"{d}.{key}", g)
    ms = list(_get(cfg, f"{d}.milestones"))
    _require(all(_number(m) and 0 <= m <= 1 for m in ms), f"{d}.milestones", ms, "progress values in [0, 1]")
    eps = _get(cfg, "d3s.eps")
    _require(_number(eps) and eps >= 0, "d3s.eps", eps, "must be >= 0")
    mkt = _get(cfg, "d3s.min_kept_tokens")
    _require(isinstance(mkt, int) and not isinstance(mkt, bool) and mkt >= 0, "d3s.min_kept_tokens", mkt,
             "must be an integer >= 0 (0 = no floor)")
    _known("d3s.sample_rule", _get(cfg, "d3s.sample_rule"), "nemo_d3s.core.sample_selection", "SAMPLE_SELECTORS")
    _known("d3s.token_scope", _get(cfg, "d3s.token_scope"), "nemo_d3s.core.token_selection", "TOKEN_SELECTORS")
    _known(f"{d}.kind", _get(cfg, f"{d}.kind"), "nemo_d3s.core.schedules", "SCHEDULES")
    _check_schedule(cfg)
    _known("d3s.dp_batch_scope", _get(cfg, "d3s.dp_batch_scope"), "nemo_d3s.distributed.topk", "DISTRIBUTED_TOKEN_SCOPES")

    a = "algorithm"
    _known(f"{a}.loss", _get(cfg, f"{a}.loss"), "nemo_d3s.core.losses", "POLICY_LOSSES")
    _known(f"{a}.advantage", _get(cfg, f"{a}.advantage"), "nemo_d3s.core.advantages", "ADVANTAGE_ESTIMATORS")
    for key in ("clip_eps_low", "clip_eps_high", "kl_coef"):
        v = _get(cfg, f"{a}.{key}")
        _require(_number(v) and v >= 0, f"{a}.{key}", v, "must be >= 0")
    dc = _get(cfg, f"{a}.dual_clip_c")
    _require(dc is None or (_number(dc) and dc > 1), f"{a}.dual_clip_c", dc, "must be > 1 or null")
    agg = _get(cfg, f"{a}.aggregation")
    aggs = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
    _require(agg in aggs, f"{a}.aggregation", agg, f"known: {', '.join(aggs)}")
    nb = _get(cfg, f"{a}.normalize_by")
    _require(nb in ("kept", "eligible"), f"{a}.normalize_by", nb, "known: kept, eligible")

    tis = _get(cfg, f"{a}.tis_cap")
    _require(tis is None or (_number(tis) and tis >= 1), f"{a}.tis_cap", tis,
             "the importance-weight cap must be >= 1 (or null for off)")
    r = "rollout"
    _known(f"{r}.engine", _get(cfg, f"{r}.engine"), "nemo_d3s.backends.engines", "ROLLOUT_ENGINES")
    gmu = _get(cfg, f"{r}.gpu_memory_utilization")
    _require(_number(gmu) and 0 < gmu <= 1, f"{r}.gpu_memory_utilization", gmu, "must be in (0, 1]")
    vtp = _get(cfg, f"{r}.tensor_parallel_size")
    _require(isinstance(vtp, int) and vtp >= 1, f"{r}.tensor_parallel_size", vtp, "must be an integer >= 1")
    es = _get(cfg, "task.eval_size")
    _require(isinstance(es, int) and es >= 1, "task.eval_size", es, "must be an integer >= 1")
    _require(bool(_get(cfg, "model.name")), "model.name", _get(cfg, "model.name"), "must name a model")
    _require(bool(_get(cfg, "output_dir")), "output_dir", _get(cfg, "output_dir"), "must be a directory path")
    _validate_faults(cfg)


def _validate_faults(cfg: Any) -> None:
    """Settings of the fault handling (issue 9): timeouts, limits, required keys."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not str(k).startswith("hydra"))
        if missing:
            raise ConfigError(f"{missing[0]}: required, but no value was given (set it with {missing[0]}=...)")
    t = "trainer"
    v = _get(cfg, f"{t}.dist_timeout_minutes")
    _require(_number(v) and v > 0, f"{t}.dist_timeout_minutes", v, "must be > 0 (minutes)")
    v = _get(cfg, f"{t}.max_failed_reward_steps")
    _require(isinstance(v, int) and v >= 0, f"{t}.max_failed_reward_steps", v, "must be an integer >= 0 (0 = never stop)")
    mes = _get(cfg, "task.max_eval_size")
    _require(isinstance(mes, int) and mes >= 1, "task.max_eval_size", mes, "must be an integer >= 1")
    es = _get(cfg, "task.eval_size")
    _require(es <= mes, "task.eval_size", es,
             f"exceeds task.max_eval_size={mes} (every evaluation generates eval_size completions); "
             "raise task.max_eval_size if you mean it")
    mpt = _get(cfg, "task.max_prompt_tokens")
    _require(mpt is None or (isinstance(mpt, int) and mpt >= 1), "task.max_prompt_tokens", mpt,
             "must be an integer >= 1 or null (the model's context length)")
    lp = _get(cfg, "task.long_prompts")
    _require(lp in ("error", "skip"), "task.long_prompts", lp, "known: error, skip")
