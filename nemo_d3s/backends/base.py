"""The seam between the backend-agnostic trainer and a model framework.

A :class:`Policy` (builds its :class:`ParallelGroups`; scores, trains, checkpoints, exports)
holds a :class:`RolloutEngine` (one seed per prompt; ``sync_weights`` after every optimizer
step). ``loss_fn`` returns the micro-batch's loss SUM; the policy applies the step normaliser
(``distributed.StepNormalizer``). Per-token tensors are token-aligned (position t: token t
from logits at t-1; position 0 holds 0); every returned tensor lives on the CPU.
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
    """Sampling settings of one generate call, validated once for every engine and config."""

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
    routed_experts [B, S, L, K] int16 or None: a mixture of experts' routing to replay in
                   every forward of the batch (``algorithm.router_replay=rollout``: the
                   engine's; -1 where the router chooses itself); a backend that cannot
                   replay refuses a batch carrying one
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    routed_experts: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "TokenBatch":
        routed = None if self.routed_experts is None else self.routed_experts[rows]
        return TokenBatch(
            self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows], routed
        )

    def truncate(self, length: int) -> "TokenBatch":
        """Cut every sequence to its first ``length`` positions."""
        return TokenBatch(
            self.input_ids[:, :length],
            self.attention_mask[:, :length],
            self.response_mask[:, :length],
            None if self.routed_experts is None else self.routed_experts[:, :length],
        )


@dataclass
class Rollouts:
    """What ``generate`` returns: one row per (prompt, sample), prompt-major."""

    batch: TokenBatch
    prompt_index: torch.Tensor  # [B] long: which input prompt each row answers
    response_texts: List[str]
    finished: torch.Tensor  # [B] bool: stopped on EOS rather than on max_new_tokens
    stats: Dict[str, float] = field(default_factory=dict)
    # [B, S] f32 token-aligned engine log-probs of the sampled tokens (vLLM), or None
    sampling_logprobs: Optional[torch.Tensor] = None
    # [B, S, L, K] int16: the experts each of the L MoE layers routed token t's input to in the
    # engine (the seeded sampler), -1 where it fed none (padding, a last token); None: a dense
    # model, or an engine that does not return its routing
    routed_experts: Optional[torch.Tensor] = None


@dataclass
class Scores:
    """What ``Policy.score`` returns: logprobs / entropy [B, S] f32, token-aligned, CPU.

    Unscored positions (prompt, padding, position 0) hold 0.
    """

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    # "fed_tokens" (rows x width, padding included) and "attended_tokens", when counted
    stats: Dict[str, float] = field(default_factory=dict)
    # [B, S, L, K] int16: the trainer's own routing of every real token of a mixture of
    # experts (-1 elsewhere), where the backend records it (HF); else None
    routed_experts: Optional[torch.Tensor] = None


# loss_fn(logprobs [b, s] f32 with grad on the model device, rows [b] long (CPU) into the
#   step's batch) -> LossOutput: ``loss`` = the micro-batch's loss SUM (no denominator),
#   ``metric_tensors`` = detached additive sums. The policy applies the step normaliser.
LossFn = Callable[[torch.Tensor, torch.Tensor], LossOutput]


class GenerationInterrupted(Exception):
    """``generate`` stopped on ``should_stop``; the step is redone on resume."""


class RolloutEngine(abc.ABC):
    """Samples completions for the trainer.

    ``prompt_seeds``: prompt i's samples depend only on prompt i, seeds[i] and the weights,
    so any batching or rank layout gives the same samples; an engine without it is wrapped
    at build time (``trainer.build.rollout_engine``).
    """

    tokenizer: Any
    prompt_seeds: bool = True
    # True: samples with the policy's own forward, so one on-policy update may skip old
    # log-probs (ratio 1); False (vLLM, own kernels): the trainer always recomputes them.
    on_policy: bool = True
    # The trainer's stop flag, asked between decode steps (vLLM: before a call only)
    should_stop: Optional[Callable[[], bool]] = None
    # True: samples from its own copy of the weights, changed by ``sync_weights`` only (so it
    # can generate while the policy trains); False: from the policy's own model
    own_weights: bool = False
    # False after :meth:`pin_weights`: ``generate`` never refits by itself
    refit_on_generate: bool = True

    def check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise GenerationInterrupted("stop requested during generation")

    @abc.abstractmethod
    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        """``n_samples`` completions per prompt (one seed each), rows [i * n, (i + 1) * n)
        answering prompts[i], right-padded [B, S] on the CPU."""

    @abc.abstractmethod
    def sync_weights(self, policy: "Policy") -> None:
        """Make the next ``generate`` sample ``policy``'s weights; collective on every rank."""

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
        """Drop the engine's own copy of the weights (vLLM: level-2 sleep) before the trainer
        needs the memory; the next ``generate`` refits if needed. Default: no-op."""

    def pin_weights(self) -> None:
        """From now on only ``sync_weights`` loads weights (a generation overlapped with
        training must not load the weights the trainer is changing) and ``generate`` returns
        the behaviour log-probs (``sampling_logprobs``) where it can."""
        self.refit_on_generate = False

    def held_weights(self) -> Optional[Iterator[Tuple[str, torch.Tensor]]]:
        """(HF name, tensor) of the engine's own copy, for a checkpoint that must regenerate
        a batch of these weights; empty where the group's engine lives on another rank; None
        where they cannot be read back (vLLM: its own processes)."""
        return None


class Policy(abc.ABC):
    """The trained model, its optimizer and (optionally) a frozen reference model.

    ``collective_export``: ``save_pretrained`` must run on every rank (it gathers shards).
    """

    groups: ParallelGroups
    tokenizer: Any
    rollout_engine: RolloutEngine
    collective_export: bool = False
    # Bumped on every weight change; an engine refits only when its version differs
    weights_version: int = 0

    def weights_changed(self) -> None:
        self.weights_version = int(self.weights_version) + 1

    def engine_returns_routing(self, returns: bool) -> None:
        """Told by the trainer on every rank, once the rollout engine is built, whether it
        returns each token's experts (vLLM with ``rollout.routed_experts``), so a policy that
        records its own routing only when there is one to compare with can do so; a policy
        whose own engine decides (the HF backend) has nothing to do."""

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
        """No-grad log-probs (+ entropy) [B, S], identical on every model-parallel rank.

        ``reference=True`` uses the frozen reference (no entropy); ``micro_batch_tokens`` > 0
        is a token budget per micro-batch, else ``micro_batch_size`` rows."""

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
        """One optimizer step over this rank's rows (may be EMPTY: it still joins every
        collective); loss sums scaled by the GLOBAL ``denominator``, grads reduced over dp.

        Returns grad_norm, lr, skipped, n_micro_batches, loss_sum, the metric sums and the
        token counts of ``Scores.stats``.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Model + optimizer (+ scheduler) state: tensors and plain containers only."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def save_pretrained(self, path: str) -> None:
        """Export the policy as a Hugging Face folder (safetensors + config + tokenizer)."""

    @abc.abstractmethod
    def hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs, gathered one at a time; collective when sharded."""

    def refit_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """``hf_weights`` left on the policy's device (no host copy), for ``backends.refit``."""
        return self.hf_weights()

    def rollout_engine_ranks(self, world_size: int) -> List[int]:
        """Global ranks that :meth:`place_rollout_engine` builds an engine on (default all)."""
        return list(range(int(world_size)))

    @property
    def weights_dtype(self) -> Optional[torch.dtype]:
        """The dtype ``hf_weights`` yields (None: ask the first tensor)."""
        return None

    def weights_copy_engine(self) -> RolloutEngine:
        """An engine with its own copy of the weights (``own_weights``) for generation
        overlapped with training. Default: ``rollout_engine``, which must hold one."""
        if not self.rollout_engine.own_weights:
            raise NotImplementedError(
                f"{type(self).__name__} has no rollout engine with its own weights copy"
            )
        return self.rollout_engine

    def place_rollout_engine(self, build: Callable[[], RolloutEngine]) -> RolloutEngine:
        """Build a separate engine (vLLM) where it belongs: every rank by default; a sharded
        policy once per model-parallel group (``megatron.engine.ModelParallelRollouts``)."""
        return build()

    def save_checkpoint(self, folder: str) -> Union[bool, List[str]]:
        """Collective. A sharded policy writes its files into ``folder`` and returns those
        this rank wrote (relative; it hashes them) or True (rank 0 hashes all); False (the
        default): the trainer saves ``state_dict()`` from rank 0."""
        return False

    def load_checkpoint(self, folder: str) -> bool:
        """Collective. True when the policy restored itself from ``folder``."""
        return False

    @property
    def context_length(self) -> Optional[int]:
        """Longest sequence (prompt + response) the model takes; None = unknown."""
        return None

    def prompt_token_counts(self, texts: Sequence[str]) -> Optional[List[int]]:
        """Tokens per prompt as the engine feeds it (chat template included); None = unknown."""
        return None

    def hf_source_dir(self) -> Optional[str]:
        """Folder with the model's config.json and tokenizer, or None (built in memory)."""
        return None
