"""Rollouts for a sharded policy: one engine per model-parallel group.

Every rank of one TP x PP group must train on the same rollouts. The engine lives on the
group's first rank (TP rank 0, PP stage 0) only; the other ranks receive its rollouts with
one object broadcast over the model-parallel group (:class:`ModelParallelRollouts`), so the
group generates once. Refits are collective (``policy.hf_weights()`` gathers over TP and
PP), so every rank of the group runs the weight iterator and only the engine's rank keeps
the tensors.

:class:`ReplicaEngine` is the CPU/test engine: the HF backend's seeded, layout-independent
sampler on a transformers copy of the policy (built from the same HF folder, then refitted
from the Megatron weights), so a Megatron run and an HF run with the same seed sample the
same rollouts. vLLM slots in as the inner engine in place of it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_d3s.backends.base import GenerationConfig, GenerationInterrupted, Policy, RolloutEngine, Rollouts
from nemo_d3s.distributed._comm import is_single

__all__ = ["ModelParallelRollouts", "ReplicaEngine"]


@dataclass
class _Replica:
    """What the HF engine reads from its policy: model, tokenizer and sampling settings."""

    model: torch.nn.Module
    tokenizer: Any
    cfg: Any  # .sampler, .generation_batch_size
    pad_id: int
    eos_ids: List[int]
    device: torch.device
    use_chat_template: bool

    def _autocast(self):
        return contextlib.nullcontext()


class ReplicaEngine(RolloutEngine):
    """The HF backend's sampler (``backends.hf.engine.HFRolloutEngine``) on a full
    transformers copy of the policy. ``sync_weights`` copies ``policy.hf_weights()`` into it
    name by name (tensor by tensor: never a second full copy in flight)."""

    def __init__(self, replica: _Replica) -> None:
        from nemo_d3s.backends.hf.engine import HFRolloutEngine

        self.replica = replica
        self.tokenizer = replica.tokenizer
        self._inner = HFRolloutEngine(replica)  # type: ignore[arg-type]
        self.prompt_seeds = self._inner.prompt_seeds

    def sync_weights(self, policy: Policy) -> None:
        from nemo_d3s.backends.hf.loading import copy_hf_weights

        model = self.replica.model
        try:
            copy_hf_weights(model, policy.hf_weights(), tie_word_embeddings=bool(model.config.tie_word_embeddings))
        except KeyError as e:
            raise KeyError(f"rollout replica refit: {e.args[0]}") from None

    def generate(self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]) -> Rollouts:
        self._inner.should_stop = self.should_stop
        return self._inner.generate(prompts, n_samples, cfg, seeds)


class ModelParallelRollouts(RolloutEngine):
    """One engine per model-parallel group: ``inner`` exists on the group's first rank
    (``src``, a global rank) and is None elsewhere.

    generate: ``src`` samples; one ``broadcast_object_list`` of the Rollouts (tensors on the
    CPU) over ``mp_group`` (in-memory objects between the job's own ranks, never a file).
    sync_weights: every rank iterates ``policy.hf_weights()`` (it is collective); ``src``
    hands the iterator to ``inner``. ``make_inner`` builds the engine lazily on ``src``.
    """

    def __init__(self, inner: Optional[RolloutEngine], tokenizer: Any, mp_group, src: int, *,
                 prompt_seeds: bool, on_policy: bool = True) -> None:
        self.inner, self.tokenizer, self.mp_group, self.src = inner, tokenizer, mp_group, src
        self._should_stop = None
        self.prompt_seeds, self.on_policy = prompt_seeds, on_policy

    @property
    def is_src(self) -> bool:
        return is_single(self.mp_group) or dist.get_rank() == self.src

    def generate(self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]) -> Rollouts:
        if is_single(self.mp_group):
            return self.inner.generate(prompts, n_samples, cfg, seeds)
        box: List[Any] = [None]
        if self.is_src:
            try:
                box[0] = self.inner.generate(prompts, n_samples, cfg, seeds)
            except GenerationInterrupted:
                box[0] = "interrupted"  # the group's other ranks stop with it
        dist.broadcast_object_list(box, src=self.src, group=self.mp_group)
        if isinstance(box[0], str):
            raise GenerationInterrupted("stop requested during generation (on the engine's rank)")
        return box[0]

    @property
    def should_stop(self):
        return self.inner.should_stop if self.inner is not None else self._should_stop

    @should_stop.setter
    def should_stop(self, fn) -> None:
        self._should_stop = fn
        if self.inner is not None:
            self.inner.should_stop = fn

    def sync_weights(self, policy: Policy) -> None:
        if self.is_src:
            self.inner.sync_weights(policy)
        else:
            for _ in policy.hf_weights():  # serve the gathers; the tensors are not needed here
                pass


def make_replica(path: str, tokenizer: Any, *, dtype: torch.dtype, device: torch.device, cfg: Any,
                 eos_ids_fn: Callable[[Any], List[int]]) -> _Replica:
    """A transformers model of the HF folder ``path`` (local files only), dropout off, in
    eval mode, for :class:`ReplicaEngine` (its weights are overwritten by the first refit)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_d3s.backends.hf.loading import zero_dropout_config

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    zero_dropout_config(config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    try:  # EOS ids as the HF backend sees them (generation_config.json may list several)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        pass  # no generation_config.json: the one derived from config.json stands
    model.to(device).eval()
    model.requires_grad_(False)
    return _Replica(model, tokenizer, cfg, int(tokenizer.pad_token_id), eos_ids_fn(model), device,
                    bool(cfg.use_chat_template))
