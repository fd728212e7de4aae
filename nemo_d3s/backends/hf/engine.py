"""The HF backend's rollout engines: :class:`HFRolloutEngine` samples from the policy's own
transformers model, sharing its weights, so ``sync_weights`` only checks it is still that
policy; :class:`ReplicaEngine` runs the same sampler on a copy refitted tensor by tensor.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, List, Sequence, Tuple, Union

import torch

from nemo_d3s.backends.base import GenerationConfig, Policy, RolloutEngine, Rollouts
from nemo_d3s.backends.hf.rollout import encode_prompts, right_padded_batch, token_aligned
from nemo_d3s.backends.hf.routing import empty_routing
from nemo_d3s.backends.hf.sampling import decode_hf_generate, decode_seeded, prompt_seeds, row_seed

__all__ = ["HFRolloutEngine", "ReplicaEngine", "SamplerModel"]


@dataclass
class SamplerModel:
    """What the sampler reads from its model: the HF backend itself, or this record around
    the Megatron backend's transformers replica."""

    model: torch.nn.Module
    tokenizer: Any
    cfg: Any  # .sampler, .generation_batch_size
    pad_id: int
    eos_ids: List[int]
    device: torch.device
    use_chat_template: bool
    autocast: Callable[[], ContextManager] = contextlib.nullcontext

    def _autocast(self) -> ContextManager:
        return self.autocast()


class HFRolloutEngine(RolloutEngine):
    """Generation with the policy's model: the seeded KV-cache sampler (default; one seed per
    prompt, layout-independent) or ``model.generate`` (``sampler="hf_generate"``, one seed per
    call; the trainer wraps it, see ``trainer.build.rollout_engine``)."""

    def __init__(self, policy: SamplerModel) -> None:
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.prompt_seeds = policy.cfg.sampler == "seeded"
        self.return_logprobs = False  # the seeded sampler's sampling_logprobs (behaviour)

    def sync_weights(self, policy: Policy) -> None:
        """Nothing to copy: the engine samples from ``policy.model`` itself."""
        if policy is not self.policy:
            raise ValueError(
                "HFRolloutEngine samples from the policy it was built with; got another policy"
            )

    @torch.no_grad()
    def generate(
        self,
        prompts: List[str],
        n_samples: int,
        cfg: GenerationConfig,
        seeds: Union[int, Sequence[int]],
    ) -> Rollouts:
        """``RolloutEngine.generate``; an int seed s means seeds s, s+1, ... (``hf_generate``:
        one int for the call). Sample j of prompt i draws from a generator seeded by
        (seed_i, j), independent of the batch up to padded-matmul float noise; the global
        RNG state is untouched."""
        p = self.policy
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if not prompts:
            raise ValueError("prompts must be non-empty")
        if self.prompt_seeds:
            per_prompt = prompt_seeds(seeds, len(prompts))
        elif isinstance(seeds, int):
            per_prompt = [seeds]
        else:
            raise ValueError(
                "sampler='hf_generate' takes one int seed per call, not one per prompt"
            )
        encoded = encode_prompts(self.tokenizer, prompts, p.use_chat_template)
        prompt_ids = [ids for ids in encoded for _ in range(n_samples)]
        chunk = p.cfg.generation_batch_size or len(prompt_ids)
        common = dict(
            cfg=cfg, pad_id=p.pad_id, eos_ids=p.eos_ids, device=p.device, autocast=p._autocast
        )
        responses, finished = [], []
        logprobs = [] if self.return_logprobs and self.prompt_seeds else None
        routing = [] if self.prompt_seeds else None  # filled for a mixture of experts
        was_training = p.model.training
        p.model.eval()
        start = time.perf_counter()
        try:
            for lo in range(0, len(prompt_ids), chunk):
                rows = prompt_ids[lo : lo + chunk]
                self.check_stop()
                if self.prompt_seeds:
                    row_seeds = [
                        row_seed(per_prompt[r // n_samples], r % n_samples)
                        for r in range(lo, lo + len(rows))
                    ]
                    r, f = decode_seeded(
                        p.model,
                        rows,
                        row_seeds,
                        check_stop=self.check_stop,
                        logprobs=logprobs,
                        routing=routing,
                        **common,
                    )
                else:
                    r, f = decode_hf_generate(p.model, rows, per_prompt[0] + lo, **common)
                responses += r
                finished += f
        finally:
            p.model.train(was_training)
        seconds = time.perf_counter() - start
        batch = right_padded_batch(prompt_ids, responses, p.pad_id)
        n_tokens = sum(len(r) for r in responses)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        stats = {
            "gen_seconds": seconds,
            "gen_tokens": float(n_tokens),
            "gen_tokens_per_s": n_tokens / max(seconds, 1e-9),
            "response_len_mean": n_tokens / len(responses),
            "finished_frac": sum(finished) / len(finished),
        }
        prompt_index = torch.arange(len(prompts)).repeat_interleave(n_samples)
        sampling = None
        if logprobs is not None:
            sampling = token_aligned(prompt_ids, logprobs, batch.input_ids.shape[1])
        finished_t = torch.tensor(finished, dtype=torch.bool)
        routed = None
        if routing and routing[0] is not None:  # rows laid out as right_padded_batch's
            L, K = routing[0].shape[1:]
            routed = empty_routing(len(routing), batch.input_ids.shape[1], L, K)
            for i, row in enumerate(routing):
                routed[i, : len(row)] = row
        return Rollouts(
            batch,
            prompt_index,
            texts,
            finished_t,
            stats,
            sampling_logprobs=sampling,
            routed_experts=routed,
        )


class ReplicaEngine(RolloutEngine):
    """The HF sampler on its own transformers copy of the policy, refitted tensor by tensor."""

    own_weights = True

    def __init__(self, replica: SamplerModel) -> None:
        self.replica = replica
        self.tokenizer = replica.tokenizer
        self._inner = HFRolloutEngine(replica)
        self.prompt_seeds = self._inner.prompt_seeds

    def sync_weights(self, policy: Policy) -> None:
        from nemo_d3s.backends.hf.loading import copy_hf_weights

        model = self.replica.model
        try:
            with torch.no_grad():
                copy_hf_weights(
                    model,
                    policy.refit_weights(),
                    tie_word_embeddings=bool(model.config.tie_word_embeddings),
                )
        except KeyError as e:
            raise KeyError(f"rollout replica refit: {e.args[0]}") from None

    def pin_weights(self) -> None:
        """Also returns the behaviour log-probs (``sampling_logprobs``) from now on: rollouts
        of pinned weights are off-policy, corrected against them."""
        self.refit_on_generate = False
        self._inner.return_logprobs = True

    def held_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The copy's parameters (a tied ``lm_head`` once, as the embedding)."""
        return ((n, p.detach()) for n, p in self.replica.model.named_parameters())

    def generate(
        self, prompts: List[str], n_samples: int, cfg: GenerationConfig, seeds: Sequence[int]
    ) -> Rollouts:
        self._inner.should_stop = self.should_stop
        return self._inner.generate(prompts, n_samples, cfg, seeds)
