"""megatron-core's router losses (``moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` > 0) over a
training step's real tokens only.

megatron-core computes both per micro-batch in ``TopKRouter.routing`` over every token its
router is fed unless the router gets a ``padding_mask`` (True = padding): then the z loss is
the mean over the unmasked tokens (0.16.1 ``transformer/moe/moe_utils.py:155-162``; 0.19.2
``:165-172``) and the load-balancing loss counts, and takes the probabilities of, the unmasked
tokens only (``compute_routing_scores_for_aux_loss`` 0.16.1 ``moe_utils.py:792-797``,
``get_tokens_per_expert_and_token_count`` ``:214-233``; 0.19.2 ``:950-955``, ``:262-280``). The
mask changes nothing else there: the top-k of every token, real or not, is taken without it
(``topk_routing_with_score_function``, 0.16.1 ``router.py:572-585``; 0.19.2 ``:774-787``) and
only an expert bias (off here) would read it. This backend feeds right padding up to a width
(``width_quantum``, TP / CP multiples, the ``allgather`` dispatcher's common width), dummy rows
and zero-weight micro-batches (``moe.align_micro_batches``, ``batches.pad_for_interleaving``);
without a mask all of it entered both losses, so the router's gradient depended on the padding.

:class:`RouterPadding` hands each router its micro-batch's mask in the router's own token order
(from ``routing.router_positions``: position -1 or an unattended position is padding) through a
forward pre-hook; GPTModel's own ``padding_mask`` argument is not used (0.16.1 scatters it for
sequence parallelism on the first pipeline stage only, ``models/gpt/gpt_model.py:305-320``). A
micro-batch without one real token (a zero-weight filler, or a rank's empty batch) computes no
router loss at all: with every token masked megatron-core's load-balancing loss is 0 / 0 (its
token count is the masked count, ``moe_utils.py:227-229``, squared in the divisor,
``:129-132``), so its router runs with ``training`` off, which in megatron-core gates the
losses and nothing else this backend uses (0.16.1 ``router.py:484``, ``:598``; 0.19.2 ``:652``,
``:799``; sinkhorn and quantile routing, never built here, also read it).

megatron-core scales each micro-batch's router-loss gradient by 1 / micro-batches (0.16.1
``pipeline_parallel/schedules.py:281-292``; 0.19.2 ``:355-361``), fillers counted, and the
gradients are averaged over DP; :func:`scaled_coefficients` multiplies the coefficients (read
on every forward: 0.16.1 ``router.py:252-262``, ``:484``; 0.19.2 ``:385-398``, ``:652``) by
(micro-batches x DP) / N for the call, N the step's micro-batches with a real token over DP
(:func:`loss_micro_batches`), so the step's router loss is the mean over those N of each one's
loss. Under sequence or context
parallelism megatron-core's z loss averages each TP x CP rank's mean over its own tokens, so
:class:`RouterPadding` weights each rank's by its share of the real tokens (the padding is not
spread evenly). What still depends on the micro-batching: each loss is megatron-core's per
micro-batch: the load-balancing loss pairs the fraction of a micro-batch's real tokens routed
to an expert with their mean probability, so it depends on which rows share a micro-batch, and
the z loss is a mean over a micro-batch's real tokens, so a row's weight depends on the
lengths of the rows it shares one with.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.megatron.batches import MicroBatch
from nemo_d3s.distributed.comm import is_single

__all__ = [
    "RouterPadding",
    "loss_micro_batches",
    "loss_padding",
    "losses_on",
    "scaled_coefficients",
]


def losses_on(router: torch.nn.Module) -> bool:
    """Whether megatron-core ``TopKRouter`` ``router`` computes a router loss in training."""
    return bool(router.is_aux_loss_enabled() or router.config.moe_z_loss_coeff)


def loss_padding(positions: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """[N] bool, True = padding: for each token a router sees (``positions``, [N] batch
    positions from ``routing.router_positions``, -1 = none) whether it is no real token of the
    [B, S] batch whose ``attended`` is the flattened [B S] attention mask."""
    inside = positions >= 0
    real = torch.zeros_like(inside)
    real[inside] = attended[positions[inside]]
    return ~real


def loss_micro_batches(
    attention_mask: torch.Tensor, mbs: Sequence[MicroBatch], groups
) -> Tuple[List[int], int]:
    """(the real tokens of each of this rank's ``mbs``, how many micro-batches hold one over
    ``groups.dp``): one all-reduce of one integer over DP."""
    tokens = [int(attention_mask[m.rows, : m.width].sum()) if len(m.rows) else 0 for m in mbs]
    n = torch.tensor([sum(t > 0 for t in tokens)], dtype=torch.long, device=groups.device)
    if not is_single(groups.dp):
        dist.all_reduce(n, group=groups.dp)
    return tokens, int(n[0])


@contextlib.contextmanager
def scaled_coefficients(routers: Sequence[torch.nn.Module], factor: float) -> Iterator[None]:
    """The routers' ``moe_aux_loss_coeff`` and ``moe_z_loss_coeff`` times ``factor`` inside the
    block (the forwards and backwards of one schedule call); the logged losses are divided by
    the coefficient in use (0.16.1 ``router.py:448-455``, ``:505-507``), so they do not move."""

    def times(v):
        if v is None:
            return None
        return type(v)(x * factor for x in v) if isinstance(v, (list, tuple)) else v * factor

    configs = list({id(r.config): r.config for r in routers}.values())
    saved = [(c.moe_aux_loss_coeff, c.moe_z_loss_coeff) for c in configs]
    if factor != 1.0:
        for c in configs:
            c.moe_aux_loss_coeff, c.moe_z_loss_coeff = (
                times(c.moe_aux_loss_coeff),
                times(c.moe_z_loss_coeff),
            )
    try:
        yield
    finally:
        for c, (aux, z) in zip(configs, saved):
            c.moe_aux_loss_coeff, c.moe_z_loss_coeff = aux, z


def _z_values() -> Optional[torch.Tensor]:
    """megatron-core's per-layer z-loss log (the live tensor; None before its first record):
    0.16.1 ``transformer/moe/moe_utils.py:893-897``, 0.19.2 ``moe_utils.py:1086-1096`` and
    ``moe_logging.py:121-125``."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("z_loss")
    return None if entry is None else entry["values"]


class RouterPadding:
    """Forward hooks on one ``TopKRouter``: the padding mask of its micro-batch's forward
    (:meth:`set`, [N] bool on the router's device, True = padding, in the router's token
    order), passed as ``TopKRouter.forward``'s ``padding_mask``; a micro-batch without a real
    token runs the router with ``training`` off (no loss). Under full activation recomputation
    the backward re-runs each layer's forward once, micro-batches in forward order: the masks
    are kept first in, first out for them (as ``routing.RouterTap``'s replayed targets).

    The z loss: megatron-core gives each TP x CP rank's mean over its own tokens the weight
    1 / (TP x CP) (0.16.1 ``router.py:486-487``; 0.19.2 ``:654-655``), right for equal shares
    of real tokens only. For this forward the coefficient is scaled by TP x CP x the rank's
    share s of the micro-batch's real tokens, so the ranks' terms add up to the mean over all
    of them, and the logged increment (the rank's own mean) is scaled by s: summed over the
    TP x CP ranks, the log is that mean too (``moe.router_loss_metrics``). s = 1 without SP
    and CP."""

    def __init__(self) -> None:
        self.given: Optional[Tuple[torch.Tensor, float, bool]] = None
        self.recompute: List[Tuple[torch.Tensor, float, bool]] = []
        self._restore: Optional[tuple] = None

    def set(self, padding: torch.Tensor, tokens: int, recompute: bool) -> None:
        """``padding`` [N] bool of a micro-batch of ``tokens`` real tokens (over its ranks)."""
        share = float((~padding).sum()) / tokens if tokens else 0.0
        self.given = (padding, share, tokens == 0)
        if recompute:
            self.recompute.append(self.given)

    def reset(self) -> None:
        self.given, self.recompute = None, []

    def before(self, router, args, kwargs):
        """``register_forward_pre_hook(..., with_kwargs=True)``: MoELayer.route calls
        ``router(hidden_states, padding_mask)`` (0.16.1 ``transformer/moe/moe_layer.py:252``;
        0.19.2 ``:444``), hidden states [s, b, h]."""
        given = self.given
        if given is None and self.recompute and torch.is_grad_enabled():
            given = self.recompute.pop(0)  # the backward's recomputation of this layer
        if given is None:
            return None
        padding, share, empty = given
        hidden = args[0]
        if padding.numel() != hidden.shape[0] * hidden.shape[1]:
            raise ValueError(
                f"router losses: a padding mask of {padding.numel()} tokens for a router fed "
                f"{tuple(hidden.shape[:2])} (tokens x rows)"
            )
        z = router.config.moe_z_loss_coeff
        if empty:
            self._restore = (router.training, None, None, 1.0)
            router.training = False
        elif z and share > 0:  # (a rank without real tokens adds 0: the count is clamped)
            scale = router.tp_cp_group.size() * share
            logged = _z_values()
            self._restore = (router.training, z, None if logged is None else logged.clone(), share)
            if scale != 1.0:
                router.config.moe_z_loss_coeff = z * scale
        kwargs = {k: v for k, v in kwargs.items() if k != "padding_mask"}
        return (hidden, padding.view(hidden.shape[:2]), *args[2:]), kwargs

    def after(self, router, args, output):
        if self._restore is None:
            return None
        training, z, logged, share = self._restore
        self._restore = None
        router.training = training
        if z is not None:
            router.config.moe_z_loss_coeff = z
            now = _z_values()
            if now is not None and share != 1.0:  # this forward's increment times the share
                base = torch.zeros_like(now) if logged is None else logged
                now.copy_(base + (now - base) * share)
        return None
