"""Packed rows (THD) and context parallelism on the Megatron backend: a pack's
``PackedSeqParams`` and the local spec's attention honouring them, the CPU twin of TE's.

megatron-core's ``DotProductAttention`` refuses packed rows and CP (0.16.1 and 0.19.2
``transformer/dot_product_attention.py:55-57, 153``). Under THD the self-attention drops the
batch dimension (``attention.py:1066-1069`` in 0.16.1, 1469 in 0.19.2) and applies RoPE per
slot (``rope_utils.py:178-238``; positions restart while ``max_seqlen < cu_seqlens[-1]``).
:class:`PackedDotProductAttention` then lets each query see its slot's keys at or before it,
under CP the K/V gathered over the CP group, with DotProductAttention's scale, fp32 softmax
and dropout; otherwise it is DotProductAttention.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

__all__ = [
    "PackedDotProductAttention",
    "packed_seq_params",
    "segment_causal_mask",
    "with_packed_attention",
]


def segment_causal_mask(
    cu_seqlens: torch.Tensor, q_positions: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[Q, T] bool, True = may attend: key j shares the slot of query position
    q_positions[i] (default: all T) and j <= it."""
    cu = cu_seqlens.long()
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])
    keys = torch.arange(int(cu[-1]), device=cu.device)
    q = keys if q_positions is None else q_positions.to(cu.device)
    return (keys.unsqueeze(0) <= q.unsqueeze(1)) & (seg[q].unsqueeze(1) == seg.unsqueeze(0))


class PackedDotProductAttention(torch.nn.Module):
    """``DotProductAttention`` (inside, at CP 1; no parameters) plus packed rows and CP."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type, **kwargs):
        super().__init__()
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        self.cp_size = int(config.context_parallel_size)
        if self.cp_size > 1:  # it asserts CP 1 (dot_product_attention.py:55-57 in 0.16.1)
            config = copy.copy(config)
            config.context_parallel_size = 1
        self.inner = DotProductAttention(
            config, layer_number, attn_mask_type, attention_type, **kwargs
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """THD [T, np, hn] -> [T, np hn]; rows [s, b, np, hn] -> [s, b, np hn]; under CP this
        rank's positions (T / CP, s / CP)."""
        a = self.inner
        if packed_seq_params is None and self.cp_size == 1:
            return a(query, key, value, attention_mask, attn_mask_type, attention_bias)
        thd = packed_seq_params is not None
        if (
            (thd and packed_seq_params.qkv_format != "thd")
            or attention_bias is not None
            or a.softmax_offset is not None
            or a.config.window_size is not None
        ):
            raise ValueError(
                "packed rows or CP on the local spec: qkv_format 'thd', no attention bias, "
                "vanilla softmax, no sliding window"
            )
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))  # b = 1
        else:  # right-padded rows: one causal sequence each
            cu = torch.tensor([0, query.shape[0] * self.cp_size])
        q_pos = None
        if self.cp_size > 1:
            from megatron.core import parallel_state as ps

            from nemo_d3s.distributed.context_parallel import ContextParallel

            cp = ContextParallel(ps.get_context_parallel_group(), cu.long().cpu())
            key, value = cp.gather(key, 0), cp.gather(value, 0)
            q_pos = cp.positions()
        context = self._attend(query, key, value, segment_causal_mask(cu.cpu(), q_pos))
        return context.squeeze(1) if thd else context

    def _attend(self, query, key, value, allowed):
        """query [sq, b, np, hn], key / value [sk, b, ng, hn], allowed [sq, sk] -> [sq, b,
        np hn]."""
        from megatron.core import tensor_parallel

        a = self.inner
        groups = a.num_attention_heads_per_partition // a.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, np, s, hn]
        scale = a.softmax_scale * (a.layer_number if a.config.apply_query_key_layer_scaling else 1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        allowed = allowed.to(scores.device)
        probs = scores.float().masked_fill(~allowed, float("-inf")).softmax(-1).to(query.dtype)
        if a.config.sequence_parallel:
            probs = a.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = a.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        sq, b = query.shape[:2]
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


def packed_seq_params(pack, device: torch.device):
    """A pack's PackedSeqParams: ``cu_seqlens`` (padded and not alike) its slot boundaries,
    int32 on ``device``; ``max_seqlen`` the longest slot, below T with two slots so RoPE
    restarts per slot (rope_utils.py:204-238 in 0.16.1, :222-259 in 0.19.2). TE reads them
    as thd with ``padding_causal`` (0.16.1 extensions/transformer_engine.py:1373-1406,
    0.19.2 :2012-2041)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = pack.cu_seqlens.to(device=device, dtype=torch.int32)
    m = pack.max_seqlen
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=m,
        max_seqlen_kv=m,
    )


def with_packed_attention(spec):
    """A copy of a local layer (or block) spec with :class:`PackedDotProductAttention` as
    its core attention."""
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec
