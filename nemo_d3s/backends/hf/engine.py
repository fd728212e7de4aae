"""The HF backend's rollout engine: samples from the policy's own transformers model, sharing
its weights, so ``sync_weights`` only checks it is still that policy.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, ContextManager, List, Sequence, Union

import torch

from nemo_d3s.backends.base import GenerationConfig, Policy, RolloutEngine, Rollouts
from nemo_d3s.backends.hf.rollout import encode_prompts, right_padded_batch
from nemo_d3s.backends.hf.sampling import decode_hf_generate, decode_seeded, prompt_seeds, row_seed

__all__ = ["HFRolloutEngine", "SamplerModel"]


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

    def _autocast(self) -> ContextManager:
        return contextlib.nullcontext()


class HFRolloutEngine(RolloutEngine):
    """Generation with the policy's model: the seeded KV-cache sampler (default; one seed per
    prompt, layout-independent) or ``model.generate`` (``sampler="hf_generate"``, one seed per
    call; the trainer wraps it, see ``trainer.build.rollout_engine``)."""

    def __init__(self, policy: SamplerModel) -> None:
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.prompt_seeds = policy.cfg.sampler == "seeded"

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
                        p.model, rows, row_seeds, check_stop=self.check_stop, **common
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
        return Rollouts(batch, prompt_index, texts, torch.tensor(finished, dtype=torch.bool), stats)
