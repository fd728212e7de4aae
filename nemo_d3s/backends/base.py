"""The seam between the backend-agnostic trainer and a model framework.

- :class:`ParallelGroups` (``nemo_d3s.distributed.groups``): frozen record of the dp / tp /
  pp / cp process groups and the device small collectives use. The POLICY builds it (HF:
  the torchrun world is the DP group; Megatron: ``initialize_model_parallel``); the trainer
  validates the config against ``groups.dp_size`` and shards prompts over ``groups.dp``.
- :class:`Policy`: the model being trained. ``score`` = one no-grad pass giving named
  log-probs + entropy [B, S]; ``train_step`` = one optimizer step over micro-batches,
  collective over all ranks (an empty local batch still joins); checkpoint state; HF export.
- :class:`RolloutEngine`: samples completions, one seed per prompt, and ``sync_weights(policy)``
  after every optimizer step (a no-op when it shares the policy's weights, a refit for vLLM).
  The policy holds it (``policy.rollout_engine``); the trainer never asks how it batches.
- Loss contract: ``loss_fn(logprobs, rows)`` returns a :class:`LossOutput` whose ``loss`` is
  the micro-batch's loss SUM and whose ``metric_tensors`` are detached sums; the policy
  multiplies by the step normaliser (``distributed.StepNormalizer``: global denominator D,
  DP averaging, a schedule's 1/num_microbatches) and reads the metrics once per step.

Per-token tensors follow ``nemo_d3s.core``'s alignment contract: position t holds the
quantity of token t computed from logits at t-1; position 0 holds 0. Every tensor a policy
or engine returns lives on the CPU.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from nemo_d3s.core.checks import is_count, is_number
from nemo_d3s.core.loss_config import LossOutput
from nemo_d3s.distributed.groups import ParallelGroups


@dataclass
class GenerationConfig:
    """Sampling settings of one generate call; checked here, once, for every engine and for
    the run config (``trainer.temperature`` etc. are judged by building one)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    do_sample: bool = True  # False = greedy (temperature, top_p and top_k unused)

    def __post_init__(self) -> None:
        if not is_count(self.max_new_tokens):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an integer >= 0")
        if self.do_sample and not (is_number(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r}: must be > 0 when sampling")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not is_count(self.top_k):
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")


@dataclass
class TokenBatch:
    """Token ids of B = (prompts x samples) sequences, right-padded to S.

    input_ids      [B, S] long   prompt + response (+ padding)
    attention_mask [B, S] bool   real tokens (prompt and response)
    response_mask  [B, S] bool   response tokens that can carry loss (incl. EOS when generated)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "TokenBatch":
        return TokenBatch(self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows])

    def truncate(self, length: int) -> "TokenBatch":
        """Cut every sequence to its first ``length`` positions (compaction after token
        selection)."""
        return TokenBatch(
            self.input_ids[:, :length],
            self.attention_mask[:, :length],
            self.response_mask[:, :length],
        )


@dataclass
class Rollouts:
    """What ``generate`` returns: one row per (prompt, sample), prompts in order, samples
    adjacent."""

    batch: TokenBatch
    prompt_index: torch.Tensor  # [B] long: which input prompt each row answers
    response_texts: List[str]
    finished: torch.Tensor  # [B] bool: stopped on EOS rather than on max_new_tokens
    stats: Dict[str, float] = field(default_factory=dict)
    # [B, S] f32: the engine's log-prob of each sampled response token (token-aligned, 0
    # elsewhere), when the engine reports it (vLLM does; compared with the trainer's old
    # log-probs to measure the rollout/train mismatch). None when not reported.
    sampling_logprobs: Optional[torch.Tensor] = None


@dataclass
class Scores:
    """What ``Policy.score`` returns, token-aligned, on the CPU.

    logprobs [B, S] f32: log pi(token t | prefix); entropy [B, S] f32 or None: full-vocabulary
    entropy of the next-token distribution at t-1 (computed without gathering a sharded
    vocabulary). Positions that were not scored (prompt, padding, position 0) hold 0.
    """

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    # Positions the pass fed the model ("fed_tokens": rows x width summed over micro-batches,
    # padding and dummy rows included) and the attended ones among them ("attended_tokens");
    # empty when the policy does not count them.
    stats: Dict[str, float] = field(default_factory=dict)


# loss_fn(logprobs [b, s] f32 with grad on the model device, rows [b] long (CPU) into the
#   step's batch) -> LossOutput: ``loss`` = the micro-batch's loss SUM (no denominator),
#   ``metric_tensors`` = detached additive sums. The policy applies the step normaliser.
LossFn = Callable[[torch.Tensor, torch.Tensor], LossOutput]


class GenerationInterrupted(Exception):
    """Raised by ``RolloutEngine.generate`` when its ``should_stop`` hook said yes mid-way
    (a stop signal): the partial rollouts are dropped, the step is redone on resume."""


class RolloutEngine(abc.ABC):
    """Samples completions for the trainer.

    ``prompt_seeds`` True: ``generate`` honours one seed per prompt and prompt i's samples
    depend only on prompt i, seeds[i] and the weights (not on the rest of the call), so any
    batching and any rank layout give the same samples. An engine without it is wrapped at
    build time (``trainer.build.rollout_engine``), never special-cased in the loop.
    """

    tokenizer: Any
    prompt_seeds: bool = True
    # True when the engine samples with the policy's own forward (same weights, same
    # numerics): a single on-policy update may then skip the old-log-prob pass (ratio 1).
    # An engine with its own copy and kernels (vLLM) sets False: the trainer then always
    # recomputes old log-probs and can compare them with ``Rollouts.sampling_logprobs``.
    on_policy: bool = True
    # Asked between decode steps by engines that decode token by token (the HF samplers);
    # True -> raise GenerationInterrupted. Set by the trainer to its stop-signal flag, so a
    # SIGTERM is honoured within one token, not one step. An engine that cannot stop inside
    # a call (vLLM) checks it only before starting.
    should_stop: Optional[Callable[[], bool]] = None

    def check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise GenerationInterrupted("stop requested during generation")

    @abc.abstractmethod
    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        """``n_samples`` completions of each prompt (one user message; the chat template is
        the engine's business); rows prompt-major: [i * n, (i + 1) * n) answer prompts[i].
        ``seeds``: one int per prompt. Returns a right-padded TokenBatch [B, S] on the CPU."""

    @abc.abstractmethod
    def sync_weights(self, policy: "Policy") -> None:
        """Make the next ``generate`` sample from ``policy``'s current weights. Called by
        the trainer after every optimizer step (on every rank: a sharded policy gathers)."""

    def alive(self) -> bool:
        """False once the engine's own processes have ended (a vLLM engine in another
        process that the job's stop signal or a fault took down): nothing is to call it then."""
        return True

    @property
    def stopped(self) -> bool:
        """Its processes ended without a fault (the job's stop signal reached them first):
        the trainer stops as on its own stop signal."""
        return False

    def release(self) -> None:
        """The trainer is about to need the memory the engine holds (scoring, the update, a
        checkpoint, an export): an engine with its own copy of the weights may drop it (vLLM:
        a level-2 sleep); its next ``generate`` refits when it must. Between two generations
        of one weights version (rollouts, evaluation batches) the trainer does not call it,
        so they cost no refit. Default: nothing to drop."""


class Policy(abc.ABC):
    """The trained model, its optimizer and (optionally) a frozen reference model.

    groups: the parallel layout it lives in (built by the policy); tokenizer: a Hugging Face
    tokenizer; rollout_engine: the engine the trainer samples with; collective_export: True
    when ``save_pretrained`` must be called on every rank (it gathers shards).
    """

    groups: ParallelGroups
    tokenizer: Any
    rollout_engine: RolloutEngine
    collective_export: bool = False
    # Bumped whenever the weights change (an optimizer step that updated them, a checkpoint
    # load): an engine with its own copy refits only when the version it holds is another one,
    # so extra generations of one version (evaluation batches) cost no refit.
    weights_version: int = 0

    def weights_changed(self) -> None:
        self.weights_version = int(self.weights_version) + 1

    @abc.abstractmethod
    def score(
        self,
        batch: TokenBatch,
        *,
        with_entropy: bool,
        reference: bool = False,
        micro_batch_size: int = 8,
        micro_batch_tokens: int = 0,
    ) -> Scores:
        """One no-grad pass over ``batch`` [B, S]: log-probs (+ entropy) of every response
        token, identical on every rank of a model-parallel group. ``reference=True`` scores
        with the frozen reference model (no entropy). Micro-batches: ``micro_batch_tokens``
        > 0 = a token budget (``core.micro_batches.token_budget_micro_batches``), else
        ``micro_batch_size`` consecutive rows."""

    @abc.abstractmethod
    def train_step(
        self,
        batch: TokenBatch,
        loss_fn: LossFn,
        *,
        micro_batch_size: int,
        denominator: float,
        micro_batch_tokens: int = 0,
    ) -> Dict[str, float]:
        """One optimizer step: forward + backward of ``batch`` (this rank's rows; may be
        EMPTY, the rank still joins every collective) in micro-batches (as in :meth:`score`),
        each ``loss_fn`` sum scaled by the step normaliser of the GLOBAL ``denominator``,
        gradient reduction over ``groups.dp``, global-norm clipping, the update.

        Returns {"grad_norm", "lr", "skipped", "n_micro_batches", "loss_sum"} plus the sums of
        ``loss_fn``'s ``metric_tensors`` over this rank's micro-batches (host-copied once),
        and "fed_tokens" / "attended_tokens" as in ``Scores.stats`` when the policy counts them.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Model + optimizer (+ LR scheduler) state for a checkpoint: tensors and plain
        containers only (loaded back with ``torch.load(weights_only=True)``)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def save_pretrained(self, path: str) -> None:
        """Export the policy as a Hugging Face folder (safetensors + config + tokenizer)."""

    @abc.abstractmethod
    def hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The current weights under Hugging Face names, one (name, full tensor) at a time,
        for a rollout engine's refit (a sharded policy gathers tensor by tensor, so no rank
        holds the whole model twice). Collective on a sharded policy."""

    def refit_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """``hf_weights`` for a rollout engine's refit (``backends.refit``): the same stream,
        but each tensor left on the policy's device (no host copy: the refit moves it GPU to
        GPU, or drops it on a rank that hosts no engine). Collective like ``hf_weights``."""
        return self.hf_weights()

    def rollout_engine_ranks(self, world_size: int) -> List[int]:
        """Global ranks that build an engine other than the policy's own, out of
        ``world_size`` (what :meth:`place_rollout_engine` does; the GPU placement is checked
        on it before any engine starts): every rank by default."""
        return list(range(int(world_size)))

    @property
    def weights_dtype(self) -> Optional[torch.dtype]:
        """The dtype ``hf_weights`` yields (None: ask the first tensor)."""
        return None

    def place_rollout_engine(self, build: Callable[[], RolloutEngine]) -> RolloutEngine:
        """Build an engine other than the policy's own (``rollout.engine=vllm``) where it
        belongs: by default on every rank (each DP replica samples its own prompts). A
        sharded policy builds it once per model-parallel group and hands the group's other
        ranks its rollouts (``backends.megatron.engine.ModelParallelRollouts``)."""
        return build()

    def save_checkpoint(self, folder: str) -> Union[bool, List[str]]:
        """Collective. A policy whose state is sharded writes its own files into ``folder``
        (every rank its part) and returns the files this rank wrote (paths relative to
        ``folder``: each rank hashes what it wrote; files no rank names, rank 0 hashes),
        or True (rank 0 then hashes them all); the default returns False and the trainer
        saves ``state_dict()`` from rank 0 (replicated state, e.g. the HF backend)."""
        return False

    def load_checkpoint(self, folder: str) -> bool:
        """Collective. The counterpart of :meth:`save_checkpoint`: True when the policy
        restored itself from ``folder``; False lets the trainer load ``state_dict()``."""
        return False

    @property
    def context_length(self) -> Optional[int]:
        """Longest sequence (prompt + response) the model takes; None = unknown, and the
        trainer then does not check prompt lengths."""
        return None

    def prompt_token_counts(self, texts: Sequence[str]) -> Optional[List[int]]:
        """Tokens of each prompt as the rollout engine will feed it (chat template included);
        None = cannot tell."""
        return None

    def hf_source_dir(self) -> Optional[str]:
        """A folder holding the model's config.json and tokenizer (an engine builds its own
        copy from it), or None when the policy was built in memory."""
        return None
