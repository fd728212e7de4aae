"""The sections of the run's config schema (composed and checked by :mod:`nemo_d3s.config`) other
than ``d3s``: objective, model, rollout engine, task, trainer loop and logging."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, Optional

from nemo_d3s.backends.base import GenerationConfig
from nemo_d3s.backends.engines import ROLLOUT_ENGINES
from nemo_d3s.backends.hf.gguf_convert import DEFAULT_MODEL_NAME
from nemo_d3s.backends.lr import LR_SCHEDULES
from nemo_d3s.backends.vllm.config import VLLMEngineConfig
from nemo_d3s.core.checks import is_count, is_number
from nemo_d3s.config_section import Section, known
from nemo_d3s.core.advantages import ADVANTAGE_ESTIMATORS
from nemo_d3s.core.loss_config import NORMALIZE_BY, LossConfig
from nemo_d3s.core.losses import POLICY_LOSSES
from nemo_d3s.core.off_policy import IS_LEVELS, IS_MODES
from nemo_d3s.core.routing import ROUTER_REPLAY

__all__ = [
    "AlgorithmConfig",
    "LoggingConfig",
    "ModelConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainerConfig",
]


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
    # Importance sampling against the log-probs the engine sampled with (vLLM's numerics; the
    # stale weights of rollout.max_staleness > 0): c caps the ratio r = pi_train_old /
    # pi_engine (null = no correction). is_correction: truncate (weight min(r, c)) | mask
    # (weight r; tokens with r outside [1/c, c] leave the loss); is_level: token | sequence
    # (the row's geometric-mean ratio on all its tokens). core/off_policy.py.
    tis_cap: Optional[float] = None
    is_correction: str = "truncate"
    is_level: str = "token"
    # A mixture of experts' routing in the trainer's forwards: "none" (its own router) |
    # "rollout" (the experts the engine routed each token to: rollout routing replay, R3 of
    # arXiv 2510.11370; the metric rollout_routing_mismatch says how often they differ)
    router_replay: str = "none"

    def loss_config(self, check_inputs: bool = True) -> LossConfig:
        """The core :class:`LossConfig` of these settings (it judges them: one rule each)."""
        return LossConfig(
            clip_eps_low=self.clip_eps_low,
            clip_eps_high=self.clip_eps_high,
            dual_clip_c=self.dual_clip_c,
            kl_coef=self.kl_coef,
            aggregation=self.aggregation,
            check_inputs=check_inputs,
        )

    def validate(self) -> None:
        known(f"{self.KEY}.loss", self.loss, POLICY_LOSSES)
        known(f"{self.KEY}.advantage", self.advantage, ADVANTAGE_ESTIMATORS)
        self._built(self.loss_config)  # clip ranges, dual clip, KL weight, aggregation
        known_by = ", ".join(NORMALIZE_BY)
        self._check(self.normalize_by in NORMALIZE_BY, "normalize_by", f"known: {known_by}")
        tis = self.tis_cap
        self._check(
            tis is None or (is_number(tis) and tis >= 1),
            "tis_cap",
            "the importance-weight cap must be >= 1 (or null for off)",
        )
        self._check(
            self.is_correction in IS_MODES, "is_correction", f"known: {', '.join(IS_MODES)}"
        )
        self._check(self.is_level in IS_LEVELS, "is_level", f"known: {', '.join(IS_LEVELS)}")
        replay = ", ".join(ROUTER_REPLAY)
        self._check(self.router_replay in ROUTER_REPLAY, "router_replay", f"known: {replay}")


@dataclass
class ModelConfig(Section):
    """The policy (``conf/model/*.yaml``). ``name`` is resolved by the backend: a registered
    short name (e.g. ``smollm2-135m-instruct``), a local Hugging Face folder or a GGUF file."""

    KEY: ClassVar[str] = "model"
    name: str = DEFAULT_MODEL_NAME
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
    """Which engine samples the rollouts (``conf/rollout/{hf,vllm}.yaml``): ``engine`` a
    ``ROLLOUT_ENGINES`` name (hf: the policy's model; vllm: in-process, refitted after every step);
    the other keys are vLLM's, checked by
    :class:`~nemo_d3s.backends.vllm.config.VLLMEngineConfig`."""

    KEY: ClassVar[str] = "rollout"
    engine: str = "hf"
    # k: step t trains on rollouts generated with the weights after step t - k, generated
    # while earlier steps train (trainer/pipeline.py); 0 = synchronous, the latest weights
    max_staleness: int = 0
    # GPUs for the vLLM engines apart from the training GPUs (non-colocated; 0: each engine on
    # its model copy's GPUs). Planned by the dry run (dry_run/overlap.py); the trainer starts
    # engines on its own ranks' GPUs only and refuses it (trainer.build.check_runtime).
    generation_gpus: int = 0

    def validate(self) -> None:
        known(f"{self.KEY}.engine", self.engine, ROLLOUT_ENGINES)
        self._check(is_count(self.max_staleness, 0), "max_staleness", "must be an integer >= 0")
        gen = self.generation_gpus
        self._check(is_count(gen, 0), "generation_gpus", "must be an integer >= 0")
        self._check(
            not gen or (self.engine == "vllm" and gen % int(self.tensor_parallel_size) == 0),
            "generation_gpus",
            "needs rollout.engine=vllm and a multiple of rollout.tensor_parallel_size",
        )
        self._check(
            self.expert_parallel is not True or self.engine == "vllm",
            "expert_parallel",
            "is vLLM's (rollout=vllm); the seeded sampler runs the policy's own layout",
        )
        vllm_keys = {f.name: getattr(self, f.name) for f in fields(VLLMEngineConfig)}
        self._built(lambda: VLLMEngineConfig(**vllm_keys))


@dataclass
class TaskConfig(Section):
    """Prompts and verifiable reward (``conf/task/*.yaml``); ``params`` go to the task's
    constructor, which rejects unknown keys."""

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


# The longest reward time limit (seconds, about 31 years): the in-process timer (setitimer) is
# refused beyond the platform's time_t (2**31 s where it is 32-bit).
MAX_TIMEOUT_S = 1e9


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
    # Rows packed end to end into micro-batches of micro_batch_tokens (or micro_batch_size
    # rows' worth) tokens, attention kept within each row: no padding; same gradient. null =
    # the backend's default: on where attention takes packed rows without a dense mask
    # (CUDA: Megatron with Transformer Engine, HF with flash attention), off on CPU.
    pack_sequences: Optional[bool] = None
    # evaluation (greedy decoding on task.eval_size held-out problems)
    eval_every: int = 10  # 0 = only at the end
    eval_at_start: bool = True
    eval_max_new_tokens: Optional[int] = None  # None = max_new_tokens
    eval_batch_size: int = 128
    # checkpoints
    # A checkpoint every save_every steps and at the last step. 0 = none at all, not even
    # at the end (a finished run cannot be continued; hf_export still holds the policy),
    # except that a stop signal (SIGTERM, SIGUSR1, Ctrl-C) still writes one so that a
    # pre-empted run can resume=true.
    save_every: int = 10
    keep_last: int = 2
    export_hf: bool = True  # DIR/hf_export at the end
    # resume=true refuses a config that changes the experiment (seed, model, algorithm,
    # d3s, task, rollout sampling, batch sizes, ...) unless this is true; the original
    # config.yaml is kept either way and the resumed one is written beside it.
    allow_config_change: bool = False
    # Stop with an error after this many consecutive steps in which every reward call
    # failed (a broken verifier); 0 = never stop.
    max_failed_reward_steps: int = 3
    # Seconds one reward call may take; a call that has not returned by then gets reward 0
    # and counts as failed (reward_errors): its worker process is killed and replaced. 0 = no
    # limit. After a stop signal (SIGTERM, Ctrl-C) the step's reward calls get 2 s more, then
    # the running ones are cut and the step redone on resume=true.
    reward_timeout_s: float = 60.0
    # Processes that score the rewards (each with its own copy of the task); 0 = the trainer
    # process itself, where the time limit is a SIGALRM that a call stuck in C code or
    # catching everything outlives, and a reward that exits or forks takes the run with it.
    reward_workers: int = 2
    # How long a collective waits for a stopped or dead peer rank before this rank exits
    # with an error: torch's and Megatron's default, 30 minutes (a checkpoint or a refit of
    # a 70B model is one collective wait). A generation is not: ranks wait for the others'
    # engines with a liveness check, up to this plus the generation's size at a floor rate
    # (distributed/generation_wait.py).
    dist_timeout_minutes: float = 30.0
    # Plan instead of train (nemo_d3s.dry_run): check the Megatron layout and print per-GPU
    # memory against gpu_memory_gb (decimal GB of one GPU); no weights, no process group.
    dry_run: bool = False
    gpu_memory_gb: float = 80.0
    # A recipe's cluster shape, nodes x gpus_per_node: the dry run's world unless NNODES /
    # GPUS_PER_NODE or Slurm's say otherwise; None = 1 x 8.
    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None

    def generation(self) -> GenerationConfig:
        """The rollouts' sampling settings, judged by GenerationConfig."""
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
            "reward_workers",
        ):
            self._check(is_count(getattr(self, name), 0), name, "must be an integer >= 0")
        lmt = self.logprob_micro_batch_tokens
        self._check(
            lmt is None or is_count(lmt, 0),
            "logprob_micro_batch_tokens",
            "must be an integer >= 0 or null",
        )
        self._built(self.generation)
        # Scoring and the update take softmax(logits / temperature) over the whole vocabulary
        # (backends' logit_temperature); a truncated sampler draws from another distribution,
        # off-policy by an amount no importance ratio here corrects.
        for name, plain_value in (("top_p", 1.0), ("top_k", 0)):
            self._check(
                getattr(self, name) == plain_value,
                name,
                f"the update scores rollouts over the whole vocabulary at the temperature; "
                f"sampling from a truncated distribution is not supported: leave "
                f"{self.KEY}.{name}={plain_value}",
            )
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
            self.lr_schedule in LR_SCHEDULES,
            "lr_schedule",
            f"known: {', '.join(LR_SCHEDULES)}",
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
            is_number(self.reward_timeout_s) and 0 <= self.reward_timeout_s <= MAX_TIMEOUT_S,
            "reward_timeout_s",
            f"must be in [0, {MAX_TIMEOUT_S:g}] (seconds; 0 = no limit; a timer beyond "
            "a 32-bit time_t is refused by the platform)",
        )
        self._check(
            is_number(self.gpu_memory_gb) and self.gpu_memory_gb > 0, "gpu_memory_gb", "must be > 0"
        )


@dataclass
class LoggingConfig(Section):
    """``logging.*``: progress bar, TensorBoard, log level, samples shown, slow-step warning."""

    KEY: ClassVar[str] = "logging"
    progress_bar: bool = True
    tensorboard: bool = True  # used when the tensorboard package is importable
    level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR | CRITICAL (nemo_d3s loggers, rank 0)
    log_samples: int = 1  # completions printed at each evaluation (rank 0)
    # Warn once when a step takes slow_step_factor x the median of the first
    # slow_step_baseline steps while the load average is above the CPU count (threads
    # oversubscribed: trainer/slow_steps.py); 0 turns it off.
    slow_step_factor: float = 3.0
    slow_step_baseline: int = 3

    def validate(self) -> None:
        levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
        self._check(self.level in levels, "level", f"unknown log level; known: {', '.join(levels)}")
        self._check(is_count(self.log_samples, 0), "log_samples", "must be an integer >= 0")
        f = self.slow_step_factor
        self._check(
            is_number(f) and (f == 0 or f > 1),
            "slow_step_factor",
            "must be 0 (off) or a number > 1",
        )
        self._check(is_count(self.slow_step_baseline, 1), "slow_step_baseline", "must be >= 1")
