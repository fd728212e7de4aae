"""AdamW on fp32 main weights for the Megatron backend's plain optimizer path
(``distributed_optimizer=false``) when the model's parameters are bf16 / fp16.

Why: AdamW's update is about ``lr`` per element. A bf16 weight w holds 8 significant bits, so
an update below ~|w| / 256 rounds back to w: at lr 1e-6 plain AdamW on bf16 parameters
changes almost no weight, and the steps are lost, not delayed. Megatron's distributed
optimizer keeps fp32 main weights for this reason (its ``Float16OptimizerWithFloat16Params``
/ ``DistributedOptimizer``); this class does the same for the plain path, without sharding.

Per model parameter ``p`` (low precision): a fp32 main copy ``main``; ``step()`` sets
``main.grad = p.main_grad``, runs AdamW on the main copies (moments fp32), then writes
``main`` back into ``p`` (rounded to its dtype). fp32 parameters are their own main weights.

Gradients are accumulated and reduced in fp32 too, as Megatron's DDP does
(``grad_reduce_in_fp32=True``: its fp32 ``main_grad`` buffers): a hook on each low-precision
parameter (``register_post_accumulate_grad_hook``) adds the gradient of each backward pass
into ``p.main_grad`` (fp32) and frees the bf16 ``p.grad``, so the sum over micro-batches and
the DP all-reduce (``optimizer.finalize_grads``) never round to bf16's 8 bits; the norm,
clipping and the step read :func:`grad_of`. Memory: per low-precision parameter 4 bytes
(main) + 8 (moments) + 4 (fp32 main_grad, from the first backward to ``zero_grad``) per
element, vs 2 x its dtype's size for plain AdamW's moments.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch

__all__ = [
    "MainWeightsAdamW",
    "adam_state_of",
    "grad_of",
    "main_weight_of",
    "needs_main_weights",
]

_FP32_GRADS = "accumulates_main_grad"  # the flag a parameter with an fp32 main_grad carries


def grad_of(p: torch.Tensor, *, zeros: bool = False) -> Optional[torch.Tensor]:
    """The gradient of ``p`` the optimizer uses: its fp32 ``main_grad`` when it accumulates
    one (:class:`MainWeightsAdamW`), else ``p.grad``. ``zeros``: a parameter no backward
    reached gets zeros of that dtype (so every rank reduces the same tensors)."""
    if getattr(p, _FP32_GRADS, False):
        g = getattr(p, "main_grad", None)
        if g is None and p.grad is not None:  # a gradient set by hand, not by a backward
            g = p.main_grad = p.grad.float()
            p.grad = None
        if g is None and zeros:
            g = p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        return g
    if p.grad is None and zeros:
        p.grad = torch.zeros_like(p)
    return p.grad


def _accumulate_main_grad(p: torch.Tensor) -> None:
    """After autograd accumulated a backward pass into ``p.grad`` (bf16): add it into the fp32
    ``p.main_grad`` and free ``p.grad``."""
    if p.grad is None:
        return
    if getattr(p, "main_grad", None) is None:
        p.main_grad = p.grad.float()
    else:
        p.main_grad.add_(p.grad)
    p.grad = None


def needs_main_weights(params: Iterable[torch.Tensor]) -> bool:
    """True when some parameter is not fp32 (bf16 / fp16)."""
    return any(p.dtype != torch.float32 for p in params)


class MainWeightsAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` over fp32 main copies of ``params`` (see the module docstring).

    ``param_groups`` / ``state`` are AdamW's, over the main copies; :meth:`main_of` maps a
    model parameter to its main copy (itself for fp32). ``zero_grad`` clears the model
    parameters' gradients too, since those are what the backward pass fills.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw) -> None:
        self.model_params: List[torch.nn.Parameter] = list(params)
        self._main: Dict[int, torch.Tensor] = {}
        mains = []
        for p in self.model_params:
            m = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            self._main[id(p)] = m
            mains.append(m)
            if m is not p and not getattr(p, _FP32_GRADS, False):
                setattr(p, _FP32_GRADS, True)
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
        super().__init__(mains, **adamw)

    def main_of(self, p: torch.Tensor) -> torch.Tensor:
        return self._main[id(p)]

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch's signature
        """fp32 gradients (:func:`grad_of`) onto the main copies, AdamW on them, main copies
        into the model."""
        if closure is not None:
            raise ValueError("MainWeightsAdamW.step takes no closure")
        pairs = [(p, self._main[id(p)]) for p in self.model_params]
        for p, m in pairs:
            if m is not p:
                m.grad = grad_of(p)
        super().step()
        for p, m in pairs:
            if m is not p:
                p.copy_(m)
                m.grad = None  # the fp32 gradient copy is transient

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p in self.model_params:
            for name in ("grad", "main_grad"):
                g = getattr(p, name, None)
                if g is not None:
                    if set_to_none:
                        setattr(p, name, None)
                    else:
                        g.zero_()


def main_weight_of(optimizer, p: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 main copy of ``p`` held by a :class:`MainWeightsAdamW` (None for another
    optimizer, or when ``p`` is fp32 and so its own main weight)."""
    if isinstance(optimizer, MainWeightsAdamW):
        m = optimizer.main_of(p)
        return None if m is p else m
    return None


def adam_state_of(optimizer, p: torch.Tensor) -> dict:
    """AdamW's state of model parameter ``p`` (keyed by its main copy under
    :class:`MainWeightsAdamW`, by ``p`` itself under plain AdamW); {} before the first step."""
    key = optimizer.main_of(p) if isinstance(optimizer, MainWeightsAdamW) else p
    return optimizer.state.get(key, {})
