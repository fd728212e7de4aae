"""Mixture-of-experts routing in the Megatron backend's forwards: each MoE router's own top-k
recorded, or replaced by a given routing (router replay), in the token order the router sees.

megatron-core's ``TopKRouter`` asks its ``router_replay`` object for the top-k
(``get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``: 0.16.1
``transformer/moe/moe_utils.py:699-707``, 0.19.2 ``:826-833``). :class:`RouterTap` stands in
for megatron-core's ``RouterReplay`` there, per router, without its process-wide list of
instances (the frozen reference model's routers are built from the same config and must keep
routing by themselves): it always records the router's own choice, and with a target it routes
each token by the target's experts with the router's scores of them (``scores.gather``, what
``RouterReplay``'s REPLAY_FORWARD returns), except where the target holds ``NO_EXPERT``: there
the router keeps its own choice (the HF backend's rule, ``backends/hf/routing.py``). TE's fused
top-k bypasses the seam (``moe_router_fusion``): this backend leaves it off.

Token order: a router of this rank sees the micro-batch's [b, L] positions sequence-first
([L, b] flattened), only this CP rank's positions of each sequence
(``distributed.ContextParallel``) and, under sequence parallelism, only this TP rank's
contiguous 1/TP of them (0.16.1: the embedding transposes to [s, b, h] and scatters along s,
``models/common/embeddings/language_model_embedding.py:120,137``, rank r keeping rows
r s/TP .. (r + 1) s/TP, ``tensor_parallel/mappings.py:71-75``; the router views its [s, b, E]
logits as [s b, E], ``transformer/moe/router.py:559-560``). :func:`router_positions`
maps each of those tokens to its position in the step's [B, S] batch, so the same map takes a
[B, S, L, K] routing to the router (replay) and the router's record back (recording).

Router losses (``moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` > 0) take the same map: in a
training call each router gets its micro-batch's padding mask in its own token order
(``router_losses``).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.megatron.batches import MicroBatch
from nemo_d3s.backends.megatron.router_losses import (
    RouterPadding,
    loss_micro_batches,
    loss_padding,
    losses_on,
    scaled_coefficients,
)
from nemo_d3s.core.routing import NO_EXPERT
from nemo_d3s.distributed.comm import group_rank, is_single
from nemo_d3s.distributed.context_parallel import ContextParallel

__all__ = ["RouterTap", "RouterTaps", "router_positions"]


def router_positions(
    mb: MicroBatch,
    seq_len: int,
    cp: Optional[ContextParallel] = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """[N] long (CPU): for each token a MoE router of this rank sees in micro-batch ``mb`` (in
    the router's order, see the module docstring), its position ``row * seq_len + column`` in
    the step's [B, seq_len] batch; -1 for a dummy row's token or a column past ``seq_len``.
    N = b x L / CP / (TP under SP)."""
    if mb.pack is not None:
        raise ValueError(
            "router replay / recording of packed micro-batches is not built (mixture-of-experts "
            "plans are of rows: trainer.pack_sequences=false)"
        )
    cols = torch.arange(mb.width)
    grid = mb.rows.long()[:, None] * seq_len + cols[None, :]
    grid = torch.where(cols[None, :] < seq_len, grid, torch.full_like(grid, -1))
    if mb.b > grid.shape[0]:  # dummy rows after the real ones (batches.model_inputs)
        grid = torch.cat([grid, grid.new_full((mb.b - grid.shape[0], mb.width), -1)])
    if cp is not None:
        grid = cp.local(grid, 1)
    tokens = grid.t()  # [L, b]: hidden states are [s, b, h] inside the model
    if sequence_parallel and tp_size > 1:
        tokens = tokens.chunk(tp_size, dim=0)[tp_rank]
    return tokens.reshape(-1)


class RouterTap:
    """One router's ``router_replay``: see the module docstring. ``target`` [N, K] long on the
    router's device or None; ``own`` the last forward's own top-k [N, K]."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # the MoE layer's index in the model (0-based)
        self.target: Optional[torch.Tensor] = None
        self.own: Optional[torch.Tensor] = None
        # targets of forwards whose activations are recomputed in the backward (full
        # recompute: the backward re-runs each checkpointed layer once, micro-batches in their
        # forward order), taken first in, first out when no target is set
        self.recompute: List[torch.Tensor] = []
        self.padding = RouterPadding()  # its router's padding mask for the router losses

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        probs, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        self.own = own.detach()
        given = self.target
        if given is None and self.recompute and torch.is_grad_enabled():
            given = self.recompute.pop(0)  # the backward's recomputation of a replayed forward
        if given is None:
            return probs, own
        if given.shape != own.shape:
            raise ValueError(
                f"router replay: MoE layer {self.layer} routes {tuple(own.shape)} tokens x "
                f"top-k, the replayed routing holds {tuple(given.shape)}"
            )
        # a token without the whole replayed top-k routes itself: mixing a partial row with its
        # own choice could name one expert twice ([5, -1] with its own [3, 5] -> [5, 5])
        target = torch.where((given < 0).any(dim=1, keepdim=True), own, given)
        return scores.gather(1, target), target


class RouterTaps:
    """:class:`RouterTap` on every MoE router of a model's chunks (the policy's; not the
    reference's), and the per-micro-batch replay / record around each forward.

    ``call(batch, mbs, groups, ...)`` opens one schedule call and yields the ``around`` that
    wraps each micro-batch's forward of a chunk; inside it ``recorded()`` gives this rank's
    record, [B, S, L, K] int16 with ``NO_EXPERT`` where this rank saw no token of that layer.
    """

    def __init__(
        self, chunks: List[torch.nn.Module], num_layers: int, topk: int, num_experts: int
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from nemo_d3s.backends.megatron.optimizer import unwrap_model

        self.num_layers, self.topk, self.num_experts = int(num_layers), int(topk), int(num_experts)
        self.by_chunk: Dict[int, List[RouterTap]] = {}
        self.routers: List[torch.nn.Module] = []
        # the last training call's micro-batches with a real token, over DP
        # (``moe.router_loss_metrics`` divides the logged losses by it)
        self.loss_micro_batches = 0
        for chunk in chunks:
            taps = []
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    if getattr(m.config, "moe_router_fusion", False):
                        raise ValueError("router replay needs moe_router_fusion=False")
                    # layer_number: 1-based over the whole model (PP / VPP offset included)
                    tap = RouterTap(int(m.layer_number) - 1)
                    m.router_replay = tap
                    m.register_forward_pre_hook(tap.padding.before, with_kwargs=True)
                    m.register_forward_hook(tap.padding.after)
                    taps.append(tap)
                    self.routers.append(m)
            self.by_chunk[id(unwrap_model(chunk))] = taps
        self._target: Optional[torch.Tensor] = None
        self._record: Optional[torch.Tensor] = None
        self._rows = self._seq = 0

    @property
    def is_moe(self) -> bool:
        return any(self.by_chunk.values())

    @contextlib.contextmanager
    def call(
        self,
        batch,
        mbs: List[MicroBatch],
        groups,
        *,
        sequence_parallel: bool,
        record: bool,
        recompute: bool = False,
        training: bool = False,
    ):
        """One schedule call over ``batch`` (a ``TokenBatch``) in micro-batches ``mbs``: yields
        the ``around(i, chunk, cp)`` of ``forward_backward.run_schedule`` (None when there is
        nothing to replay, record or mask). Replays ``batch.routed_experts``; ``record``: see
        :meth:`recorded` inside the block; ``recompute`` (a training call under full activation
        recomputation): each replayed target and padding mask is kept for the backward's
        recomputed forward. ``training`` with router losses on: each router gets its padding
        mask, the coefficients are scaled to a mean over the step's real micro-batches and
        :attr:`loss_micro_batches` counts them (``router_losses``; one all-reduce over DP).
        """
        losses = training and any(losses_on(r) for r in self.routers)
        if batch.routed_experts is None and not record and not losses:
            yield None
            return
        B, S = batch.input_ids.shape
        tp_rank, tp_size = group_rank(groups.tp), groups.tp_size
        attended = batch.attention_mask.reshape(-1).bool()
        factor = 1.0
        if losses:
            tokens, n = loss_micro_batches(batch.attention_mask, mbs, groups)
            factor = len(mbs) * groups.dp_size / n if n else 1.0
            self.loss_micro_batches = n

        def around(i: int, chunk: torch.nn.Module, cp: Optional[ContextParallel]):
            positions = router_positions(
                mbs[i],
                S,
                cp,
                tp_rank=tp_rank,
                tp_size=tp_size,
                sequence_parallel=sequence_parallel,
            )
            padding = (loss_padding(positions, attended), tokens[i]) if losses else None
            return self.around(chunk, positions, recompute, padding)

        with self.routing(batch.routed_experts, (B, S), record):
            with scaled_coefficients(self.routers if losses else [], factor):
                yield around

    @contextlib.contextmanager
    def routing(self, batch_routing: Optional[torch.Tensor], shape: Tuple[int, int], record: bool):
        """One schedule call over a [B, S] batch: replay ``batch_routing`` [B, S, L, K] (None:
        the routers' own choice); ``record``: keep every router's own choice."""
        B, S = shape
        if batch_routing is not None:
            want = (B, S, self.num_layers, self.topk)
            if tuple(batch_routing.shape) != want:
                raise ValueError(
                    f"router replay: routing {tuple(batch_routing.shape)} is not "
                    f"[{B}, {S}, {self.num_layers}, {self.topk}] (rows, positions, MoE layers, "
                    "top-k)"
                )
            lo, hi = (
                (int(batch_routing.min()), int(batch_routing.max()))
                if batch_routing.numel()
                else (0, 0)
            )
            if lo < NO_EXPERT or hi >= self.num_experts:
                raise ValueError(
                    f"router replay: routing holds experts {lo}..{hi}, outside [0, "
                    f"{self.num_experts}) and {NO_EXPERT} (none)"
                )
            self._target = batch_routing.reshape(B * S, self.num_layers, self.topk)
        self._rows, self._seq = B, S
        self._record = (
            torch.full((B * S, self.num_layers, self.topk), NO_EXPERT, dtype=torch.int16)
            if record
            else None
        )
        try:
            yield self
            left = sum(
                len(t.recompute) + len(t.padding.recompute)
                for taps in self.by_chunk.values()
                for t in taps
            )
            if left:  # a kept layer's backward did not recompute it: the FIFO would drift
                raise RuntimeError(
                    f"router replay / losses: {left} layer forwards kept for their "
                    "recomputation were never recomputed"
                )
        finally:
            self._target = None
            for taps in self.by_chunk.values():
                for t in taps:
                    t.target, t.own, t.recompute = None, None, []
                    t.padding.reset()

    def recorded(self) -> torch.Tensor:
        """This rank's record of the call [B, S, L, K] int16 (``routing(record=True)``)."""
        return self._record.view(self._rows, self._seq, self.num_layers, self.topk)

    @contextlib.contextmanager
    def around(
        self,
        chunk: torch.nn.Module,
        positions: torch.Tensor,
        recompute: bool = False,
        padding: Optional[Tuple[torch.Tensor, int]] = None,
    ) -> Iterator[None]:
        """Micro-batch forward of ``chunk`` whose routers see the batch positions ``positions``
        [N] (:func:`router_positions`); ``recompute``: see :meth:`call`; ``padding``: (the
        routers' padding mask [N] bool, the micro-batch's real tokens) for the router
        losses."""
        from nemo_d3s.backends.megatron.optimizer import unwrap_model

        taps = self.by_chunk.get(id(unwrap_model(chunk)), [])
        valid = positions >= 0
        if self._target is not None and taps:
            # [N, L, K]; dummy tokens: the router's own choice
            target = torch.full((len(positions), *self._target.shape[1:]), NO_EXPERT)
            target[valid] = self._target[positions[valid]].long()
            target = target.to(next(chunk.parameters()).device)
            for t in taps:
                t.target = target[:, t.layer]
                if recompute:
                    t.recompute.append(t.target)
        if padding is not None and taps:
            mask = padding[0].to(next(chunk.parameters()).device)
            for t in taps:
                t.padding.set(mask, padding[1], recompute)
        try:
            yield
        finally:
            for t in taps:
                t.target = None
                t.padding.given = None
        if self._record is not None and taps:
            own = torch.stack([t.own for t in taps], dim=1).cpu().to(torch.int16)  # [N, l, K]
            layers = torch.tensor([t.layer for t in taps])
            keep = valid.nonzero().squeeze(1)
            self._record[positions[keep][:, None], layers[None, :]] = own[keep]


def combine_recorded(record: torch.Tensor, groups, device: torch.device) -> torch.Tensor:
    """Every rank's record of one model copy joined: each (token, layer) was seen by one TP
    (sequence-parallel chunk) x CP (positions) x PP (layers) rank, ``NO_EXPERT`` elsewhere, so
    an element-wise MAX over those groups gives the copy's routing on each of its ranks.
    Collectives: one all-reduce (MAX) of [B, S, L, K] int32 per group of size > 1 (NCCL has no
    int16): 4 x B x S x L x K bytes each."""
    x = record.to(device=device, dtype=torch.int32)
    for g in (groups.tp, groups.cp, groups.pp):
        # (a model copy's ranks hold the same rows: all of them skip an empty record alike)
        if x.numel() and not is_single(g):
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)
    return x.cpu().to(torch.int16)
