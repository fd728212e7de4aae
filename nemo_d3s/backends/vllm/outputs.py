"""vLLM's ``RequestOutput`` list -> :class:`Rollouts`: every sample cut at the first stop id,
its sampled log-probs token-aligned, cut (aborted) or failed requests refused, and each token's
experts when the engine returns them."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from nemo_d3s.backends.base import GenerationInterrupted, Rollouts
from nemo_d3s.backends.hf.rollout import cut_at_eos, right_padded_batch, token_aligned
from nemo_d3s.backends.vllm.routing import routing_rows

__all__ = ["rollouts_from_outputs"]


def rollouts_from_outputs(
    outputs: Sequence[Any],
    encoded: Sequence[Sequence[int]],
    n_samples: int,
    *,
    tokenizer: Any,
    eos_ids: Sequence[int],
    pad_id: int,
    moe_shape: Optional[Any] = None,
) -> Rollouts:
    """``LLM.generate``'s outputs for prompts ``encoded`` (token ids), ``n_samples`` each ->
    Rollouts, sample j of prompt i at row i * n_samples + j, right-padded [B, S] with
    ``sampling_logprobs`` [B, S] (the engine's own). ``moe_shape``: the engine returns each
    token's experts (``routed_experts`` [B, S, layers, top-k])."""
    _check_finished(outputs)
    prompt_ids, responses, finished, logprobs, texts = [], [], [], [], []
    routed, generated = [], []
    for ids, out in zip(encoded, outputs):
        if len(out.outputs) != n_samples:
            raise RuntimeError(
                f"vLLM returned {len(out.outputs)} samples for a prompt, expected {n_samples}"
            )
        for comp in out.outputs:
            resp, hit = cut_at_eos(list(comp.token_ids), eos_ids)
            prompt_ids.append(ids)
            responses.append(resp)
            finished.append(hit or comp.finish_reason == "stop")
            logprobs.append(_sampled_logprobs(comp.logprobs, resp))
            texts.append(tokenizer.decode(resp, skip_special_tokens=True))
            routed.append(getattr(comp, "routed_experts", None))
            generated.append(len(comp.token_ids))
    batch = right_padded_batch(prompt_ids, responses, pad_id)
    sampling = token_aligned(prompt_ids, logprobs, batch.input_ids.shape[1])
    routing = None
    if moe_shape is not None:
        routing = routing_rows(
            routed,
            [len(p) for p in prompt_ids],
            generated,
            [len(r) for r in responses],
            batch.input_ids.shape[1],
            moe_shape,
        )
    n_tokens = sum(len(r) for r in responses)
    stats = {
        "gen_tokens": float(n_tokens),
        "response_len_mean": n_tokens / max(len(responses), 1),
    }
    prompt_index = torch.arange(len(encoded)).repeat_interleave(n_samples)
    return Rollouts(
        batch,
        prompt_index,
        texts,
        torch.tensor(finished, dtype=torch.bool),
        stats,
        sampling_logprobs=sampling,
        routed_experts=routing,
    )


def _check_finished(outputs: Sequence[Any]) -> None:
    """Refuse cut rollouts: on SIGTERM vLLM's engine core sends every request in flight back
    finished with ``finish_reason`` "abort" (vllm 0.33 ``v1/engine/core.py:1703-1735``,
    ``v1/request.py:407``) and ``LLM.generate`` returns them (``entrypoints/common/
    offline.py:610-616``): GenerationInterrupted. "error" (the engine failed): RuntimeError."""
    reasons = [c.finish_reason for out in outputs for c in out.outputs]
    aborted, failed = reasons.count("abort"), reasons.count("error")
    if aborted:
        raise GenerationInterrupted(
            f"the vLLM engine aborted {aborted} of {len(reasons)} rollouts (finish_reason "
            "'abort': its processes got a stop signal); none is used"
        )
    if failed:
        raise RuntimeError(f"the vLLM engine failed on {failed} of {len(reasons)} rollouts")


def _sampled_logprobs(
    entries: Optional[Iterable[Dict[int, Any]]], tokens: Sequence[int]
) -> List[float]:
    """vLLM's per-position {token_id: Logprob} dicts -> the sampled tokens' log-probs."""
    if entries is None:
        return [0.0] * len(tokens)
    out = []
    for tok, entry in zip(tokens, entries):
        lp = entry.get(tok) if entry else None
        out.append(float(lp.logprob) if lp is not None else 0.0)
    return out
