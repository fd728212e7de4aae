"""AdamW on fp32 main weights for the plain optimizer path when parameters are bf16 / fp16:
an update below ~|w| / 256 would round back to a bf16 w (as Megatron's optimizers, unsharded).

Each backward is accumulated into an fp32 ``p.main_grad`` (a post-accumulate hook frees the
bf16 ``p.grad``), so micro-batch sums and the DP reduce stay fp32; read it with
:func:`grad_of`. Memory per low-precision element: 4 (main) + 8 (moments) + 4 (main_grad).
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
    """``p``'s fp32 ``main_grad`` when it accumulates one, else ``p.grad``; ``zeros``: fill
    in zeros where no backward reached (every rank reduces the same tensors)."""
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
    """Move a backward's bf16 ``p.grad`` into the fp32 ``p.main_grad``."""
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
    """``torch.optim.AdamW`` over fp32 main copies of ``params`` (fp32 ones are their own);
    ``step`` writes the main copies back into the model."""

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
        """AdamW on the main copies with the fp32 grads, then main copies into the model."""
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
    """The fp32 main copy of ``p`` in a :class:`MainWeightsAdamW`, else None."""
    if isinstance(optimizer, MainWeightsAdamW):
        m = optimizer.main_of(p)
        return None if m is p else m
    return None


def adam_state_of(optimizer, p: torch.Tensor) -> dict:
    """AdamW's state of model parameter ``p`` ({} before the first step)."""
    key = optimizer.main_of(p) if isinstance(optimizer, MainWeightsAdamW) else p
    return optimizer.state.get(key, {})
