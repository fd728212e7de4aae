"""The MoE routing of a transformers model, recorded and replayed through forward hooks on its
routers: transformers 5's ``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter`` and
``MixtralTopKRouter`` (each layer's ``mlp.gate``) take the hidden states [b, s, H] flattened to
[b s, H] and return (router logits [b s, E], top-k scores [b s, K], top-k experts [b s, K])
(transformers 5.24 ``models/qwen3_moe/modeling_qwen3_moe.py`` :250-268, ``qwen2_moe`` :311-329,
``mixtral`` :96-111); the sparse block routes the tokens by the last two.

- :class:`RouterHooks` ``record()``: each forward appends every layer's experts, [b, s, L, K]
  int16 (on the model's device: 2 bytes per token, layer and expert slot);
- ``replay(target)``: the routers return ``target`` [b, s, L, K] as their experts and the scores
  of those experts (``core.routing.replay_topk_scores``: the softmax over all E, renormalised
  over the K where the router renormalises: Mixtral always, Qwen3-MoE / Qwen2-MoE with
  ``norm_topk_prob``), so the forward uses the engine's routing and the router's gradient
  flows through the scores it gives the replayed experts.

Under gradient checkpointing (``RouterHooks(model, recompute=True)``) the backward runs each
layer's forward again, after the replay's context has closed: the hooks then stay on the routers
for the model's life and every layer keeps the routing it replayed in a grad-enabled forward,
first in first out, for the recomputed forward to route by (what megatron-core's replay does,
``backends/megatron/routing.py``). Outside a context and with nothing kept the hooks change
nothing; they act only on the routers of the model they were made for (a deep copy of the model,
the frozen reference, carries copies of them).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Deque, Iterator, List, Optional, Tuple

import torch

from nemo_d3s.core.routing import NO_EXPERT, replay_topk_scores

__all__ = ["RouterHooks", "moe_routers", "empty_routing", "unpack_routing", "check_replay"]


ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")


def moe_routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's MoE routers in layer order ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


class RouterHooks:
    """Record or replay the routing of ``model``'s MoE layers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, recompute: bool = False) -> None:
        self.routers = moe_routers(model)
        self.recorded: List[torch.Tensor] = []  # per forward: [b, s, L, K] int16, as routed
        self.recorded_own: List[torch.Tensor] = []  # the routers' own choice (replay aside)
        self._layers: List[torch.Tensor] = []
        self._own: List[torch.Tensor] = []
        self._target: Optional[torch.Tensor] = None
        self._active = False
        # per layer, the [b s, K] routings replayed with grad on, for the backward's recompute
        self.recompute = recompute
        self._kept: List[Deque[torch.Tensor]] = [collections.deque() for _ in self.routers]
        if recompute:  # for the model's life: the backward recomputes after the context closed
            for i, r in enumerate(self.routers):
                r.register_forward_hook(self._hook(i))

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    def _renormalises(self, router: torch.nn.Module) -> bool:
        return type(router).__name__ == "MixtralTopKRouter" or bool(
            getattr(router, "norm_topk_prob", False)
        )

    def _replayed(self, router, logits, scores, target):
        probs = torch.softmax(logits.float(), dim=-1)
        return replay_topk_scores(probs, target, self._renormalises(router)).to(scores.dtype)

    def _hook(self, layer: int):
        def hook(router, args, output):
            if router is not self.routers[layer]:
                return None  # a copy of the model (the reference): not ours to route
            logits, scores, experts = output
            if not self._active:  # the backward's recomputed forward, or any other forward
                kept = self._kept[layer]
                if not (kept and torch.is_grad_enabled()):
                    return None
                target = kept.popleft()
                return logits, self._replayed(router, logits, scores, target), target
            self._own.append(experts.detach())
            if self._target is not None:
                target = self._target[..., layer, :].reshape(-1, experts.shape[-1])
                target = target.to(device=experts.device, dtype=experts.dtype)
                if target.shape != experts.shape:
                    raise ValueError(
                        f"router replay: layer {layer} routes {tuple(experts.shape)} tokens x "
                        f"top-k, the replayed routing holds {tuple(target.shape)}"
                    )
                # positions with nothing recorded keep the router's own choice
                own = target < 0
                target = torch.where(own, experts, target)
                scores = self._replayed(router, logits, scores, target)
                experts = target
                if self.recompute and torch.is_grad_enabled():
                    self._kept[layer].append(target)
            self._layers.append(experts.detach())
            return logits, scores, experts

        return hook

    @contextlib.contextmanager
    def _hooked(self, b: int, s: int, target: Optional[torch.Tensor]) -> Iterator[None]:
        left = sum(len(k) for k in self._kept)
        if left:
            self._kept = [collections.deque() for _ in self.routers]
            raise RuntimeError(
                f"router replay: {left} layer routings kept for a recomputed forward were not "
                "used (a backward that did not recompute, or a forward that ran twice)"
            )
        handles = []
        if not self.recompute:
            handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        self._layers, self._own, self._target, self._active = [], [], target, True
        try:
            yield
            if len(self._layers) != len(self.routers):
                raise RuntimeError(
                    f"{len(self._layers)} router calls in a forward of {len(self.routers)} "
                    "MoE layers"
                )
            K = self._layers[0].shape[-1]
            used = torch.stack([x.view(b, s, K) for x in self._layers], dim=2).to(torch.int16)
            self.recorded.append(used)
            # the routers' own choice takes memory of its own only where a replay overrode it
            own = used
            if self._target is not None:
                own = torch.stack([x.view(b, s, K) for x in self._own], dim=2).to(torch.int16)
            self.recorded_own.append(own)
        finally:
            for h in handles:
                h.remove()
            self._layers, self._own, self._target, self._active = [], [], None, False

    def pop(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The last forward's (routing used, the routers' own choice), [b, s, L, K] each."""
        return self.recorded.pop(), self.recorded_own.pop()

    def forward(self, b: int, s: int, target: Optional[torch.Tensor]):
        """``replay(target)`` when a routing is given, else ``record(b, s)``."""
        return self.record(b, s) if target is None else self.replay(target)

    def record(self, b: int, s: int) -> contextlib.AbstractContextManager:
        """Around one forward of input [b, s]: append its routing [b, s, L, K] to ``recorded``."""
        return self._hooked(b, s, None)

    def replay(self, target: torch.Tensor) -> contextlib.AbstractContextManager:
        """Around one forward of input [b, s]: route by ``target`` [b, s, L, K] (``NO_EXPERT``
        where the router chooses for itself); the routing used is recorded too."""
        if target.dim() != 4 or target.shape[2] != len(self.routers):
            L = len(self.routers)
            raise ValueError(f"router replay: routing {tuple(target.shape)} is not [b, s, {L}, K]")
        return self._hooked(target.shape[0], target.shape[1], target)


def empty_routing(b: int, s: int, layers: int, k: int) -> torch.Tensor:
    """[b, s, L, K] of ``NO_EXPERT`` (int16: experts < 32768)."""
    return torch.full((b, s, layers, k), NO_EXPERT, dtype=torch.int16)


def unpack_routing(pack: Any, routing: torch.Tensor, width: int) -> torch.Tensor:
    """A pack's [T, L, K] routing (``core.packing.PackedMicroBatch``) -> [n, width, L, K] int16
    in its rows' columns, ``NO_EXPERT`` elsewhere."""
    r, c, p = pack.tokens(0)
    out = empty_routing(len(pack.rows), width, *routing.shape[1:])
    out[r, c] = routing.cpu()[p].to(out.dtype)
    return out


def check_replay(batch: Any, hooks: RouterHooks, reference: bool) -> None:
    """A batch's routing to replay needs a mixture of experts; the frozen reference keeps its own
    routing (ValueError otherwise)."""
    if batch.routed_experts is not None and (reference or not hooks.is_moe):
        what = "the reference model routes by itself" if reference else "a dense model"
        raise ValueError(f"router replay: {what}, it cannot take routed_experts")
