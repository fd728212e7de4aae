"""Context parallelism: one micro-batch's sequences cut over the CP group and gathered back
(``core.context_parallel``'s chunking). The CPU attention gathers K/V with it, the loss
functions the per-token log-probs and entropy, so every CP rank sees whole rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_d3s.core.context_parallel import all_zigzag_positions, zigzag_positions
from nemo_d3s.distributed.comm import group_rank, group_size

__all__ = ["ContextParallel"]


@dataclass(frozen=True)
class ContextParallel:
    """group: the CP group; cu_seqlens [n + 1]: the sequences along the micro-batch's length
    L ([0, L] for rows, a pack's slots)."""

    group: dist.ProcessGroup
    cu_seqlens: torch.Tensor

    @property
    def size(self) -> int:
        return group_size(self.group)

    def positions(self) -> torch.Tensor:
        """[L / CP] long (CPU): this rank's global positions, in its local order."""
        return zigzag_positions(self.cu_seqlens, self.size, group_rank(self.group))

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """x [.., L, ..] (length along ``dim``) -> [.., L / CP, ..]: this rank's positions."""
        return x.index_select(dim, self.positions().to(x.device))

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's x [.., L / CP, ..] -> [.., L, ..], global order, on every CP rank.
        One all-gather; backward: one all-reduce, then this rank's positions."""
        return _Gather.apply(x, dim, self)


class _Gather(torch.autograd.Function):
    """:meth:`ContextParallel.gather`; the backward all-reduces (gloo has no
    reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, cp: ContextParallel) -> torch.Tensor:
        ctx.dim, ctx.cp = dim, cp
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        order = all_zigzag_positions(cp.cu_seqlens, cp.size)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return torch.cat(parts, dim=dim).index_select(dim, inverse.to(x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.cp.group)
        return ctx.cp.local(grad, ctx.dim), None, None
