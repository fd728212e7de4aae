"""Pipeline parallelism: per-token results are born on the last stage (the only one with logits) and
every stage needs what decides the update.

:func:`logprob_loss_func` computes entropy / old log-probs in the old-policy pass on the last stage;
:func:`broadcast_per_token` sends all micro-batches' results to every stage in one broadcast, so
every stage runs the same deterministic selection and denominators on its own DP group with no
further PP traffic; :func:`train_loss_func` computes the training loss SUM scaled by the step's
``StepNormalizer``. No Megatron import: groups come in as arguments and the loss functions follow
the schedule's contract (``(loss, logs)``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_d3s.core.entropy import align_to_tokens
from nemo_d3s.core.packing import PackedMicroBatch
from nemo_d3s.distributed.context_parallel import ContextParallel
from nemo_d3s.distributed.comm import (
    collective_device,
    global_rank_of,
    group_rank,
    group_size,
    is_single,
)
from nemo_d3s.distributed.normalizers import StepNormalizer
from nemo_d3s.distributed.vocab_parallel import vocab_parallel_entropy_and_logprobs

__all__ = [
    "is_last_stage",
    "last_stage_rank",
    "broadcast_from_last_stage",
    "PerTokenStore",
    "logprob_loss_func",
    "train_loss_func",
    "fit_width",
    "broadcast_per_token",
]

_WIRE_DTYPE = {torch.bool: torch.uint8}  # gloo and NCCL broadcast bytes, not bools


def is_last_stage(pp_group: Optional[dist.ProcessGroup]) -> bool:
    """Whether this rank is the last stage of ``pp_group`` (True without pipelining)."""
    return group_rank(pp_group) == group_size(pp_group) - 1


def last_stage_rank(pp_group: dist.ProcessGroup) -> int:
    """Global rank of the last stage of ``pp_group`` (torch's broadcast ``src``)."""
    return global_rank_of(pp_group, group_size(pp_group) - 1)


def broadcast_from_last_stage(
    tensor: Optional[torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    pp_group: Optional[dist.ProcessGroup],
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The last stage's ``tensor`` (``shape``, ``dtype``) on every stage; elsewhere pass None and a
    buffer is allocated on ``device`` (default: CUDA for NCCL, CPU for gloo). One broadcast on
    ``pp_group``; None or one stage returns ``tensor``."""
    if is_single(pp_group):
        return tensor
    wire = _WIRE_DTYPE.get(dtype, dtype)
    if is_last_stage(pp_group):
        if tensor is None or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            raise ValueError(
                f"the last stage must pass a tensor of shape {tuple(shape)} and dtype "
                f"{dtype}, got {got}"
            )
        buf = tensor.to(wire).contiguous()
    else:
        buf = torch.empty(tuple(shape), dtype=wire, device=device or collective_device(pp_group))
    dist.broadcast(buf, src=last_stage_rank(pp_group), group=pp_group)
    return buf.to(dtype) if wire != dtype else buf


@dataclass
class PerTokenStore:
    """Per-micro-batch results of the last stage: a list of {name: [B_i, S_i] f32}."""

    names: Tuple[str, ...] = ("entropy", "logprobs")
    micro_batches: List[Dict[str, torch.Tensor]] = field(default_factory=list)

    def clear(self) -> None:
        self.micro_batches.clear()


def _token_logprobs(
    logits, ids, tp_group, token_aligned, seq_first, vocab_size, chunk_size, cp=None, T=1.0
):
    """Vocab-parallel (entropy, logprobs) of one micro-batch at temperature ``T``; token-aligned
    [B, S] when asked (with ``cp``: each local position scores its successor, then gathered
    over CP)."""
    if cp is not None and not token_aligned:  # CP scores position t from t - 1 itself
        raise ValueError(
            "cp needs token_aligned=True (input ids, not targets shifted by the caller)"
        )
    kw = dict(vocab_size=vocab_size, chunk_size=chunk_size, temperature=T)
    if seq_first:  # Megatron's [S, B, V/TP]: a transposed view, never a copy of the logits
        logits = logits.transpose(0, 1)
    if cp is not None:  # the logits at t score token t + 1, wherever t + 1 lives
        pos = cp.positions().to(ids.device)
        nxt = ids.index_select(1, (pos + 1).clamp(max=ids.shape[1] - 1))
        entropy, logprobs = vocab_parallel_entropy_and_logprobs(logits, nxt, tp_group, **kw)
        entropy, logprobs = cp.gather(entropy, 1), cp.gather(logprobs, 1)
        return align_to_tokens(entropy[:, :-1]), align_to_tokens(logprobs[:, :-1])
    if token_aligned:  # token t is scored by the logits at t - 1; position 0 gets 0
        # Every position is scored (the last against a stand-in id) and the last COLUMN of the
        # [B, S] results dropped: scoring the view logits[:, :-1] would make the backward hold a
        # second [B, S, V/TP] gradient (a slice's backward zero-fills the full shape, then copies).
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        entropy, logprobs = vocab_parallel_entropy_and_logprobs(logits, nxt, tp_group, **kw)
        return align_to_tokens(entropy[:, :-1]), align_to_tokens(logprobs[:, :-1])
    return vocab_parallel_entropy_and_logprobs(logits, ids, tp_group, **kw)


def logprob_loss_func(
    store: PerTokenStore,
    target_ids: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    *,
    token_aligned: bool = False,
    vocab_size: Optional[int] = None,
    chunk_size: int = 1024,
    seq_first: bool = False,
    cp: Optional[ContextParallel] = None,
    temperature: float = 1.0,
) -> Callable[[torch.Tensor], Tuple[torch.Tensor, dict]]:
    """Loss function for Megatron's forward-only old-policy pass (one per micro-batch): called on
    the last stage with logits [B, S, V/TP] (``seq_first``: [S, B, V/TP]), it appends
    ``{"entropy", "logprobs"}`` [B, S] f32 to ``store`` and returns a zero loss.

    target_ids [B, S]: shifted by the caller, or input ids with ``token_aligned=True`` (position t
    from logits at t - 1, position 0 holds 0). ``cp`` (needs ``token_aligned``): the logits are
    this CP rank's positions; whole rows are stored (all-gathers over CP). ``temperature``: of
    softmax(logits / T), the rollouts' sampling distribution. Collectives: the vocab-parallel
    ones on ``tp_group``."""

    def loss_func(logits: torch.Tensor):
        with torch.no_grad():
            entropy, logprobs = _token_logprobs(
                logits,
                target_ids,
                tp_group,
                token_aligned,
                seq_first,
                vocab_size,
                chunk_size,
                cp,
                temperature,
            )
        store.micro_batches.append({"entropy": entropy.float(), "logprobs": logprobs.float()})
        return logits.new_zeros((), dtype=torch.float32), {}

    return loss_func


def fit_width(x: torch.Tensor, width: int, value=0) -> torch.Tensor:
    """[n, S] -> [n, width]: cut, or pad on the right with ``value``."""
    S = x.shape[1]
    if width <= S:
        return x[:, :width]
    return F.pad(x, (0, width - S), value=value)


def train_loss_func(
    input_ids: torch.Tensor,
    attended: torch.Tensor,
    rows: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], Any],
    normalizer: StepNormalizer,
    tp_group: Optional[dist.ProcessGroup],
    *,
    width: Optional[int] = None,
    on_sum: Optional[Callable[[str, torch.Tensor], None]] = None,
    vocab_size: Optional[int] = None,
    chunk_size: int = 1024,
    seq_first: bool = False,
    pack: Optional[PackedMicroBatch] = None,
    cp: Optional[ContextParallel] = None,
    temperature: float = 1.0,
) -> Callable[[torch.Tensor], Tuple[torch.Tensor, dict]]:
    """The training-pass loss function for one micro-batch on the last stage.

    input_ids [b, L] (b >= n: dummy rows last); attended [n, L]; rows [n]: the real rows. The
    returned function turns logits [b, L, V/TP] (``seq_first``: [L, b, V/TP]) into differentiable
    token-aligned log-probs of the n real rows, zero where not attended, cut or widened to
    ``width``; ``loss_fn(logprobs [n, width] f32, rows)`` gives the loss SUM (or an object with
    ``loss`` and ``metric_tensors``). Returns ``(sum x normalizer.loss_scale, {})``; ``on_sum``
    receives "loss_sum" and every metric. n = 0 gives a zero loss with zero gradient (the rank still
    joins the collectives). ``pack``: input_ids [1, L] hold the rows, unpacked per row
    (``attended`` unused). ``cp``: the logits are this CP rank's positions, the log-probs
    gathered over CP and the loss x 1 / CP (the gather's backward and forward_step multiply by
    CP, the DP x CP average divides once). Collectives: the vocab-parallel forward on
    ``tp_group``; with ``cp`` an all-gather (backward: an all-reduce)."""
    n = len(rows)
    cp_scale = 1.0 / cp.size if cp is not None else 1.0

    def loss_func(logits: torch.Tensor):
        _, lp = _token_logprobs(
            logits, input_ids, tp_group, True, seq_first, vocab_size, chunk_size, cp, temperature
        )
        if n == 0:  # zero-weight micro-batch: gradient 0, every collective still runs
            loss = lp.sum() * 0.0
            if on_sum is not None:
                on_sum("loss_sum", loss)
            return loss, {}
        w = lp.shape[1] if width is None else width
        if pack is None:
            lp = fit_width(lp[:n].float() * attended, w)
        else:
            lp = pack.unpack(lp[0].float(), w)
        out = loss_fn(lp, rows)
        loss, metrics = (
            (out, {}) if isinstance(out, torch.Tensor) else (out.loss, out.metric_tensors)
        )
        if on_sum is not None:
            on_sum("loss_sum", loss)
            for k, v in metrics.items():
                on_sum(k, v)
        # A new tensor: the schedule divides what it gets IN PLACE by num_microbatches.
        return loss * (normalizer.loss_scale * cp_scale), {}

    return loss_func


def broadcast_per_token(
    store: Optional[PerTokenStore],
    shapes: Sequence[Tuple[int, int]],
    pp_group: Optional[dist.ProcessGroup],
    *,
    names: Sequence[str] = ("entropy", "logprobs"),
    device: Optional[torch.device] = None,
) -> List[Dict[str, torch.Tensor]]:
    """Every micro-batch's per-token results, from the last stage's ``store`` (None elsewhere) to
    all stages: shapes [(B_i, S_i)] known everywhere -> one {name: [B_i, S_i] f32} per micro-batch.
    ONE broadcast of ``len(names) x sum_i B_i S_i`` floats on ``pp_group``; the results are views
    into that buffer."""
    sizes = [int(b) * int(s) for b, s in shapes]
    total = sum(sizes) * len(names)
    last = is_last_stage(pp_group)
    flat = None
    if last:
        if store is None or len(store.micro_batches) != len(shapes):
            n = None if store is None else len(store.micro_batches)
            raise ValueError(
                f"the last stage holds {n} micro-batch results, shapes lists {len(shapes)}"
            )
        parts = []
        for mb, shape in zip(store.micro_batches, shapes):
            for name in names:
                if tuple(mb[name].shape) != tuple(shape):
                    raise ValueError(
                        f"{name} has shape {tuple(mb[name].shape)}, shapes says {tuple(shape)}"
                    )
                parts.append(mb[name].reshape(-1).float())
        flat = torch.cat(parts) if parts else torch.zeros(0)
        device = flat.device
    flat = broadcast_from_last_stage(flat, (total,), torch.float32, pp_group, device)
    out, pos = [], 0
    for (b, s), n in zip(shapes, sizes):
        mb = {}
        for name in names:
            mb[name] = flat[pos : pos + n].view(int(b), int(s))
            pos += n
        out.append(mb)
    return out
