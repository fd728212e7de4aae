"""One call of megatron-core's forward/backward function for ``schedule``: the micro-batches
checked against the layout (:func:`plan_call`), each one's inputs (this CP rank's
positions, a pack's PackedSeqParams) and the p2p settings (:func:`run_schedule`)."""

from __future__ import annotations

import math
import contextlib
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Tuple

import torch

from nemo_d3s.backends.base import TokenBatch
from nemo_d3s.backends.megatron.batches import (
    MicroBatch,
    pad_for_interleaving,
    plan_micro_batches,
    plan_packed,
)
from nemo_d3s.backends.megatron.local_attention import packed_seq_params
from nemo_d3s.backends.megatron.moe import align_micro_batches
from nemo_d3s.backends.megatron.optimizer import unwrap_model
from nemo_d3s.distributed.comm import is_single
from nemo_d3s.distributed.context_parallel import ContextParallel
from nemo_d3s.distributed.groups import ParallelGroups

__all__ = ["check_call_layout", "plan_call", "run_schedule"]


def check_call_layout(groups: ParallelGroups, config, n_chunks: int) -> None:
    """ValueError unless the model chunks and the layout fit one call of the schedules."""
    if groups.pp_size > 1 and getattr(config, "pipeline_dtype", None) is None:
        raise ValueError(
            "pipeline_model_parallel_size > 1 needs TransformerConfig.pipeline_dtype (the "
            "p2p dtype)"
        )
    if n_chunks > 1:
        from megatron.core import parallel_state as ps

        vpp = (
            ps.get_virtual_pipeline_model_parallel_world_size()
            if ps.model_parallel_is_initialized()
            else None
        )
        if groups.pp_size < 2 or vpp != n_chunks:
            raise ValueError(
                f"got {n_chunks} model chunks: a virtual pipeline (interleaved 1F1B) needs "
                f"pipeline_model_parallel_size > 1 (have {groups.pp_size}) and Megatron's virtual "
                f"pipeline size = the number of chunks (have {vpp})"
            )


def plan_call(
    batch: TokenBatch,
    groups: ParallelGroups,
    chunks: List[torch.nn.Module],
    micro_batch_size: int,
    micro_batch_tokens: int,
    pack: bool = False,
    quantum: int = 0,
) -> List[MicroBatch]:
    """The call's micro-batches (:func:`batches.plan_micro_batches`, or the packs of
    :func:`batches.plan_packed`), checked against the layout; with model chunks (interleaved
    1F1B) padded with zero-weight micro-batches to a multiple of PP
    (:func:`batches.pad_for_interleaving`). Under CP every sequence (a row, a pack's slot)
    is a multiple of 2 x CP (its chunks) and its CP share a multiple of TP under SP."""
    config = getattr(unwrap_model(chunks[0]), "config", None)
    check_call_layout(groups, config, len(chunks))
    cp = groups.cp_size
    multiple = groups.tp_size if getattr(config, "sequence_parallel", False) else 1
    multiple = math.lcm(2 * cp, cp * multiple) if cp > 1 else multiple
    if pack:
        mbs = plan_packed(
            batch.attention_mask,
            micro_batch_size,
            micro_batch_tokens,
            multiple_of=multiple,
            seq_multiple=2 * cp if cp > 1 else 1,
            quantum=quantum,
        )
    else:
        mbs = plan_micro_batches(
            batch.attention_mask,
            micro_batch_size,
            uniform=groups.pp_size > 1,
            multiple_of=multiple,
            max_tokens=micro_batch_tokens,
            quantum=quantum,
        )
    if len(chunks) == 1:
        return align_micro_batches(mbs, groups, config)
    # PP 2: the two stages exchange activations AND gradients in one p2p batch (each is the
    # other's previous and next stage), and megatron-core's shape exchange for variable
    # shapes posts them in an order that pairs one direction's send with the other's
    # receive (p2p_communication.py:205-230): one shape for every micro-batch there.
    mbs = pad_for_interleaving(mbs, groups.pp_size, one_shape=groups.pp_size == 2)
    return align_micro_batches(mbs, groups, config)


def run_schedule(
    chunks: List[torch.nn.Module],
    micro_batches: List[MicroBatch],
    inputs: Callable[[int], Tuple[Any, ...]],
    loss_for: Callable[[int, Tuple[Any, ...], Optional[ContextParallel]], Callable],
    *,
    forward_only: bool,
    cp_group=None,
    around: Optional[
        Callable[[int, torch.nn.Module, Optional[ContextParallel]], ContextManager]
    ] = None,
) -> None:
    """One call of Megatron's forward/backward function over ``micro_batches``.

    ``inputs(i)`` -> (ids, pos, mask, attended, pack) of micro-batch i; ``loss_for(i,
    inputs, cp)`` -> the loss function the schedule applies to micro-batch i's output on the
    last stage. ``cp_group`` (CP > 1): the model gets this CP rank's positions of each
    sequence (``distributed.ContextParallel``), no mask (the attention builds it), and the
    loss function the gather back. ``around(i, chunk, cp)``: a context around micro-batch i's
    forward of a chunk (``routing.RouterTaps``: a MoE routing replayed and recorded).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    def forward_step(data_iterator: Iterator[int], model: torch.nn.Module):
        i = next(data_iterator)
        x = inputs(i)
        ids, pos, mask, cp = x[0], x[1], x[2], None
        if not is_single(cp_group):
            bounds = torch.tensor([0, ids.shape[1]]) if x[4] is None else x[4].cu_seqlens
            cp = ContextParallel(cp_group, bounds)
            ids, pos, mask = cp.local(ids, 1), cp.local(pos, 1), None
        packed = None if x[4] is None else packed_seq_params(x[4], ids.device)
        with around(i, model, cp) if around is not None else contextlib.nullcontext():
            out = model(ids, pos, mask, packed_seq_params=packed)
        return out, loss_for(i, x, cp)

    first = micro_batches[0]
    n = len(micro_batches)
    # interleaved 1F1B: one data iterator per model chunk; each chunk runs every micro-batch
    # in order (megatron-core 0.16.1 schedules.py:912-916 asserts the list)
    data = [iter(range(n)) for _ in chunks] if len(chunks) > 1 else iter(range(n))
    # Micro-batches of different [L, b]: 1F1B must send each shape first, else it allocates
    # receives at [seq_length, mbs, hidden] (megatron-core 0.16.1 p2p_communication.py:301).
    # Interleaved PP 2: batched p2p would pair a gradient with an activation
    # (p2p_communication.py:18-50); the unbatched _p2p_ops (lines 53-121) keeps them apart.
    config = get_model_config(chunks[0])
    variable = len({(m.b, m.width) for m in micro_batches}) > 1
    pp2_interleaved = len(chunks) > 1 and _pp_size() == 2
    before = config.variable_seq_lengths, config.batch_p2p_comm
    config.variable_seq_lengths = before[0] or variable
    config.batch_p2p_comm = before[1] and not pp2_interleaved
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=chunks,
            num_microbatches=n,
            seq_length=first.width,  # read by 1F1B only, when every micro-batch has this shape
            micro_batch_size=first.b,
            forward_only=forward_only,
        )
    finally:
        config.variable_seq_lengths, config.batch_p2p_comm = before


def _pp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()
