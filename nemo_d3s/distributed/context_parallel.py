"""Context parallelism: a micro-batch's sequences split over the CP group, gathered back.

Each CP rank holds its 2 of 2 x CP chunks of every sequence (``core.context_parallel``).
:class:`ContextParallel` is one micro-batch's view of that: :meth:`~ContextParallel.local`
cuts a full [.., L, ..] tensor to this rank's positions, :meth:`~ContextParallel.gather`
puts every rank's positions back in global order on every rank, differentiably (the
backward of the all-gather sums each position's gradient over the CP ranks and hands it to
the rank that holds it: ``torch.distributed.nn.functional.all_gather``, a reduce-scatter on
NCCL, an all-to-all on gloo). The CPU attention gathers K and V with it; the loss functions
gather per-token log-probs and entropy with it, so every CP rank sees whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_d3s.core.context_parallel import all_zigzag_positions, zigzag_positions
from nemo_d3s.distributed.comm import group_rank, group_size

__all__ = ["ContextParallel"]


@dataclass(frozen=True)
class ContextParallel:
    """group: the CP group (size > 1); cu_seqlens [n + 1] long: the micro-batch's sequence
    boundaries along its length L ([0, L] for rows of L; a pack's slots), each sequence a
    multiple of 2 x CP long."""

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
        """This rank's x [.., L / CP, ..] -> [.., L, ..] in global order, identical on every
        CP rank; differentiable: the backward sums the [.., L, ..] gradient over the CP ranks
        (one all-reduce) and keeps this rank's positions. Collective: one all-gather of x
        over ``group``. Memory: the CP parts and the reordered result."""
        return _Gather.apply(x, dim, self)


class _Gather(torch.autograd.Function):
    """:meth:`ContextParallel.gather` with its backward (an all-reduce, which gloo and NCCL
    both run, then this rank's slice: the reduce-scatter of the all-gather)."""

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
