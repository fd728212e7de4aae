"""The CPU compatibility layer's share for megatron-core's mixture-of-experts modules
(``cpu_compat.apply_cpu_compat`` applies it): which MoE modules see the CPU ``torch`` proxy,
the proxy's ``torch.distributed`` (uneven gathers as on NCCL), the router's gating matmul
without Transformer Engine, and the all-to-all dispatcher's host-side split sizes. Each
patch cites the megatron-core lines it stands for (0.16.1; 0.19.2 where they moved)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["MOE_TORCH_PROXIED", "CpuDistributed", "patch_dtoh_copies", "patch_router_gemm"]

# megatron-core MoE modules whose module-level ``torch`` becomes cpu_compat's proxy.
MOE_TORCH_PROXIED = {
    # TopKRouter.gating moves the router weight to ``torch.cuda.current_device()`` on every
    # forward (0.16.1 transformer/moe/router.py:89-92; 0.19.2 router.py:97-100), and its
    # __init__ allocates expert-bias buffers there (0.16.1 router.py:163-199).
    "megatron.core.transformer.moe.router": "TopKRouter.gating/__init__",
    # MoEAlltoAllTokenDispatcher.__init__ builds a ``torch.cuda.Stream()`` for its
    # device-to-host copies (0.16.1 transformer/moe/token_dispatcher.py:444-445; 0.19.2
    # :468-469) and _maybe_dtoh_and_synchronize compares, waits on and enters it and
    # synchronises its event (0.16.1 :871-898; 0.19.2 :922-949).
    "megatron.core.transformer.moe.token_dispatcher": (
        "MoEAlltoAllTokenDispatcher.__init__/_maybe_dtoh_and_synchronize"
    ),
    # save_to_aux_losses_tracker allocates its per-layer loss log with device="cuda"
    # (0.16.1 transformer/moe/moe_utils.py:998).
    "megatron.core.transformer.moe.moe_utils": "save_to_aux_losses_tracker",
}


class CpuDistributed:
    """``torch.distributed`` as the proxied megatron modules see it. NCCL's ``all_gather`` and
    ``reduce_scatter`` take tensor lists of unequal first dimensions, gloo's do not; the
    all-to-all dispatcher's gather and scatter over expert TP pass exactly those (0.16.1
    transformer/moe/token_dispatcher.py:696-705 with ``output_split_sizes``, through
    tensor_parallel/mappings.py:144-150 and :184-193). Here an uneven all-gather is an
    even one of zero-padded rows, cut back; a list reduce-scatter is an all-reduce of the
    concatenation, this rank's rows kept (the same sums, more bytes on the wire)."""

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        out = [torch.empty_like(padded) for _ in tensor_list]
        torch.distributed.all_gather(out, padded, group=group)
        for t, o in zip(tensor_list, out):
            t.copy_(o[: t.shape[0]])
        return None

    @staticmethod
    def reduce_scatter(output, input_list, op=None, group=None, async_op: bool = False):
        if op not in (None, torch.distributed.ReduceOp.SUM) or async_op:
            raise NotImplementedError("cpu_compat: reduce_scatter of a list sums synchronously")
        full = torch.cat([t.reshape(t.shape[0], -1) for t in input_list])
        torch.distributed.all_reduce(full, group=group)
        mine = full.split([t.shape[0] for t in input_list])[torch.distributed.get_rank(group)]
        output.copy_(mine.view_as(output))
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


def patch_router_gemm() -> None:
    """``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` on every
    forward and backward (0.16.1 transformer/moe/moe_utils.py:1192, :1225), but 0.16.1 binds
    that name only when Transformer Engine imports (:23-39): without TE the test raises
    NameError unless the router runs in fp64. Binding it to None takes the torch matmul
    branch the module already has (0.19.2 binds None itself: moe_utils.py:41-53)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def patch_dtoh_copies() -> None:
    """The all-to-all dispatcher hands its split sizes to ``all_to_all_single`` as numpy
    arrays made by ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` at its device-to-host
    point (0.16.1 transformer/moe/token_dispatcher.py:876-893), but that helper converts CUDA
    tensors only (0.16.1 moe_utils.py:1093-1099; 0.19.2 :1184-1190) and leaves a CPU tensor
    a tensor, which torch's all-to-all refuses as split sizes. The dispatcher's view of the
    helper converts CPU tensors the same way (no copy: they are on the host already)."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_nemo_d3s_cpu", False):
        return

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._nemo_d3s_cpu = True
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
