"""Packed (THD) rows on the Megatron backend: the ``PackedSeqParams`` of a pack
(:func:`packed_seq_params`) and the local layer spec's core attention honouring them, the
CPU twin of Transformer Engine's ``TEDotProductAttention``.

megatron-core's own ``DotProductAttention`` refuses ``packed_seq_params`` (megatron-core
0.16.1 and 0.19.2 ``transformer/dot_product_attention.py:153``), so only TE's attention runs
THD. :class:`PackedDotProductAttention` runs it on the local spec: with
``qkv_format="thd"`` the self-attention squeezes the batch dimension away (``transformer/
attention.py:1066-1069`` in 0.16.1) and applies RoPE per slot of ``cu_seqlens`` (the
``_apply_rotary_pos_emb_thd`` it calls, ``models/common/embeddings/rope_utils.py:178-238``:
positions restart at each slot while the RoPE table is shorter than the pack,
``max_seqlen < cu_seqlens[-1]``); here query [T, np, hn] attends to the keys of its own slot
at or before it (block-diagonal causal over ``cu_seqlens_q_padded``, else ``cu_seqlens_q``),
with DotProductAttention's scale, fp32 softmax and dropout. Without ``packed_seq_params`` it
is DotProductAttention unchanged. :func:`with_packed_attention` puts it into a local layer spec.
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
    """[Q, T] bool, True = may attend: key j is in the slot of ``cu_seqlens`` [n + 1] that
    holds query position q_positions[i] (default: all T positions) and j <= it. Memory:
    Q T bytes."""
    cu = cu_seqlens.long()
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])
    keys = torch.arange(int(cu[-1]), device=cu.device)
    q = keys if q_positions is None else q_positions.to(cu.device)
    return (keys.unsqueeze(0) <= q.unsqueeze(1)) & (seg[q].unsqueeze(1) == seg.unsqueeze(0))


class PackedDotProductAttention(torch.nn.Module):
    """megatron-core's ``DotProductAttention`` (built inside, same arguments, at CP 1; it
    holds no parameters) that also runs ``packed_seq_params`` and context parallelism: see
    the module docstring."""

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
        """THD: query [T, np, hn], key / value [T, ng, hn] -> [T, np hn]; rows: [s, b, np, hn]
        -> [s, b, np hn]. Under CP the local positions of each sequence (T / CP, s / CP)."""
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
        np hn] with DotProductAttention's scale, fp32 softmax and dropout."""
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
    """megatron-core's PackedSeqParams (THD) of a pack: ``cu_seqlens`` its slot boundaries,
    padded and unpadded alike (padding is part of a slot, after its real tokens: causal
    attention never reads it), int32 on the model device; ``max_seqlen`` the longest slot,
    below T whenever there are two slots, so RoPE restarts per slot (megatron-core 0.16.1
    rope_utils.py:204-238, 0.19.2 :222-259). TE's attention reads these (0.16.1
    extensions/transformer_engine.py:1373-1406: thd with ``padding_causal``), the CPU spec's
    and :class:`PackedDotProductAttention` the same."""
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
    """A copy of a local layer spec (a ``ModuleSpec`` of one layer or a block's
    ``TransformerBlockSubmodules``) whose self-attention's core attention is
    :class:`PackedDotProductAttention`."""
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec
