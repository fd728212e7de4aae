"""The interface between the backend-agnostic trainer and a model framework.

A backend owns the policy model, its optimizer and (optionally) a frozen reference model,
and the parallel layout they live in. The trainer owns the algorithm: rewards, advantages,
selections, the loss function and its global denominator.

Two implementations are planned and the interface is shaped for both:

- ``backends/hf``: transformers model on CPU or one GPU; data parallel over a torch
  process group (gradients all-reduced by hand).
- ``backends/megatron``: megatron-core GPTModel under TP/PP/DP; ``train_step`` drives
  Megatron's pipeline schedule over micro-batches, and the loss callback receives
  per-token log-probs computed from vocab-sharded logits on the last pipeline stage.
  Generation there is delegated to a separate engine (vLLM or Megatron inference).

All per-token tensors follow the alignment contract of ``nemo_d3s.core``: position t
holds the quantity of token t computed from logits at t-1; position 0 holds 0.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True


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
        """Cut every sequence to its first ``length`` positions (compaction after token selection)."""
        return TokenBatch(
            self.input_ids[:, :length], self.attention_mask[:, :length], self.response_mask[:, :length]
        )


@dataclass
class Rollouts:
    """What ``generate`` returns: one row per (prompt, sample), prompts in order, samples adjacent."""

    batch: TokenBatch
    prompt_index: torch.Tensor  # [B] long: which input prompt each row answers
    response_texts: List[str]
    finished: torch.Tensor  # [B] bool: stopped on EOS rather than on max_new_tokens
    stats: Dict[str, float] = field(default_factory=dict)


# loss_fn(logprobs [b, s] f32 with grad, micro-batch rows [b] long into the step's batch)
#   -> scalar loss already divided by the GLOBAL denominator (so micro-batch and DP-rank
#      contributions add up to the full-batch loss).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PolicyBackend(abc.ABC):
    """What the trainer needs from a model framework."""

    tokenizer: object  # a Hugging Face tokenizer (Megatron runs use one too)
    # True when ``generate`` takes one seed per prompt with per-prompt independence (see
    # ``generate``); a class attribute or a property.
    supports_prompt_seeds: bool = False

    @abc.abstractmethod
    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seed: Union[int, Sequence[int]]
    ) -> Rollouts:
        """Sample ``n_samples`` completions for each chat-formatted prompt text.

        ``seed``: an int for the whole call, or (only when the backend class sets
        ``supports_prompt_seeds`` is True) a sequence of one int per prompt; such a backend
        guarantees that prompt i's samples depend only on prompt i, seeds[i] and the model,
        not on the other prompts of the call (so any batching or rank layout gives the same
        samples). A backend without it is called once per prompt to get that guarantee.
        """

    @abc.abstractmethod
    def compute_logprobs(
        self, batch: TokenBatch, *, with_entropy: bool, reference: bool = False, micro_batch_size: int = 8
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One no-grad pass: (logprobs [B, S] f32, entropy [B, S] f32 or None), token-aligned.

        Entropy is the full-vocabulary entropy of the next-token distribution; a
        vocab-parallel backend computes it without gathering the vocabulary. With
        ``reference=True`` the frozen reference model is used (no entropy).
        """

    @abc.abstractmethod
    def train_step(self, batch: TokenBatch, loss_fn: LossFn, micro_batch_size: int) -> Dict[str, float]:
        """Forward + backward over micro-batches of ``batch`` (data-parallel gradient
        reduction included), gradient clipping and one optimizer step.

        Returns at least {"grad_norm": float, "lr": float}.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Model + optimizer (+ scheduler) state for a checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @abc.abstractmethod
    def save_pretrained(self, path: str) -> None:
        """Export the policy as a Hugging Face folder (safetensors + config + tokenizer)."""
