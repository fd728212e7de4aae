"""The dry run's memory model: what one GPU of a Megatron layout holds, as formulas of the
model's shape and the step's workload (pure arithmetic: no torch, no config).

Memory model, per GPU at (TP rank, PP stage), bytes (P = this position's parameters incl.
vocabulary padding, d = bytes of the model dtype: 2 for bf16; DP = data-parallel size):

- weights: d P. grads: 4 P (Megatron DDP reduces in fp32: ``grad_reduce_in_fp32=True``).
- optimizer: Megatron's distributed optimizer shards fp32 main weights + Adam's two moments
  over DP: 12 P / DP (8 P / DP for fp32 weights, which are their own main copy). Together
  with the two lines above this is megatron-core's ``6 + 12/DP`` bytes per parameter.
  With ``model.params.distributed_optimizer=false`` (plain AdamW over each rank's shards):
  grads d P, not sharded over DP, and fp32 main weights + moments 12 P (8 P for fp32
  weights; ``main_weights.MainWeightsAdamW``).
- activations (flash attention, no sequence parallelism, no dropout: what the backend
  builds), per layer and micro-batch of b rows x s tokens, stored for the backward:
  ``s b d [4 h + (2 d_h (a + g) + 3 F) / TP]`` (h hidden, a heads, g KV heads, d_h head
  dim, F FFN width): two RMSNorm inputs and two normed linear inputs [s, b, h] replicated
  over TP; per TP shard q, k, v [s, b, d_h (a + 2 g)], the attention output [s, b, d_h a],
  the SwiGLU input [s, b, 2 F] and output [s, b, F]. This is Korthikanti et al. (2022,
  Table 2, ``sbh (10 + 24/t)`` with selective recompute) re-derived for GQA + SwiGLU without
  dropout masks (-2 sbh) and with the gated FFN's wider fc1 output. 1F1B keeps up to
  ``min(PP - stage, micro-batches)`` micro-batches in flight, each holding the stage's
  L / PP layers, so the first stage holds about L layers' worth. With
  ``model.gradient_checkpointing=true`` (Megatron full recompute, one layer at a time) only
  each layer's input ``2 s b h`` is kept, plus one layer's full set while it is recomputed.
- logits (last stage): the [b, s, V_pad / TP] logits of one micro-batch in the model dtype,
  kept for the backward, plus their gradient (2 d bytes per element: with bf16 the size of
  one fp32 copy), or the scoring pass's ``logprob_micro_batch_size`` rows (d bytes per
  element), whichever is larger, plus the vocab-parallel kernel's fp32 chunk workspace
  (3 buffers of ``entropy_chunk_size x V_pad / TP``).
- reference: d P when ``algorithm.kl_coef > 0`` (a frozen copy of the stage).
- hf_replica (``rollout.engine=hf`` only, on the first GPU of each TP x PP group): the HF
  sampler's full copy of the model, d N; hf_kv_cache: its KV cache for the rows it
  generates at once (all of its group's rollouts, or ``generation_batch_size``).
- runtime: 2 GB for the CUDA context, NCCL communicators and allocator slack (assumed).
- vllm (``rollout.engine=vllm``, colocated): the engine takes ``gpu_memory_utilization`` x
  the GPU while it generates (its weights d N / vLLM-TP, its profiled activations and the
  KV cache); it sleeps while the policy trains (``rollout.sleep``). One engine per TP x PP
  group, started on that group's first rank (Megatron's rank order puts those ranks on the
  first nodes), its vLLM-TP workers on that node: ``vllm_shards_per_gpu`` engines share the
  busiest GPU. The training state (weights, grads, optimizer, reference) stays resident
  while vLLM generates. KV budget per GPU = utilization x GPU - vLLM weights - vLLM
  activations (``8192`` batched tokens profiled); vLLM refuses to start when it cannot hold
  one ``max_model_len`` sequence.

Peaks (resident = weights + grads + optimizer + reference + hf_replica + runtime): training
= resident + activations + logits (+ vLLM when it does not sleep); generation = resident +
hf_kv_cache or shards x utilization x GPU. The verdict compares
the larger with ``trainer.gpu_memory_gb`` (decimal GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = [
    "GB", "RUNTIME_BYTES", "VLLM_PROFILE_TOKENS", "RESIDENT", "TRAINING", "GENERATION", "Workload",
    "layer_activation_bytes", "activation_bytes", "logits_bytes", "kv_bytes_per_token", "vllm_activation_bytes",
    "megatron_lm_reference",
]

GB = 10**9
# Which memory terms are held when: all the time, while the policy trains, while the engine generates.
RESIDENT = ("weights", "grads", "optimizer", "reference", "hf_replica")
TRAINING = ("activations", "logits")
GENERATION = ("hf_kv_cache", "vllm")
RUNTIME_BYTES = 2 * GB  # CUDA context + NCCL communicators + allocator slack (an assumption)
VLLM_PROFILE_TOKENS = 8192  # vLLM profiles one forward of this many batched tokens at start
_CHUNK_BUFFERS = 3  # fp32 [chunk, V/TP] buffers the vocab-parallel kernel holds at once


@dataclass(frozen=True)
class Workload:
    """What one training step asks of a GPU."""

    seq_len: int  # longest training row: prompt limit + max_new_tokens
    gen_len: int  # longest generated sequence (KV cache): prompt limit + max(new, eval new)
    micro_batch: int
    logprob_micro_batch: int
    micro_batches: int  # per DP rank and optimizer step, all rollouts kept (an upper bound)
    rows_per_engine: int  # rollouts one engine generates per step
    recompute: bool
    dtype_bytes: int
    chunk: int  # entropy_chunk_size


def layer_activation_bytes(h: int, heads: int, kv_heads: int, head_dim: int, ffn: int, *, b: int, s: int,
                           tp: int, dtype_bytes: int = 2) -> float:
    """Bytes one transformer layer stores for the backward (the module docstring)."""
    per_token = 4 * h + (2 * head_dim * (heads + kv_heads) + 3 * ffn) / tp
    return s * b * dtype_bytes * per_token


def _layer_bytes(spec, w: Workload, tp: int, b: Optional[int] = None) -> float:
    return layer_activation_bytes(spec.hidden_size, spec.num_heads, spec.kv_heads, spec.head_dim,
                                  spec.ffn_hidden_size, b=b or w.micro_batch, s=w.seq_len, tp=tp,
                                  dtype_bytes=w.dtype_bytes)


def activation_bytes(spec, w: Workload, *, tp: int, pp: int, stage: int) -> Tuple[float, int]:
    """(stored activation bytes of stage ``stage`` under 1F1B, micro-batches in flight)."""
    in_flight = max(1, min(pp - stage, w.micro_batches))
    layers = spec.num_layers // pp
    full = _layer_bytes(spec, w, tp)
    if not w.recompute:
        return in_flight * layers * full, in_flight
    kept = w.seq_len * w.micro_batch * spec.hidden_size * w.dtype_bytes  # each layer's input
    return in_flight * layers * kept + full, in_flight


def logits_bytes(padded_vocab: int, w: Workload, *, tp: int) -> Tuple[float, str]:
    """(bytes, which pass) of the last stage's logits: training (logits + gradient) or
    scoring (logits only), whichever is larger, plus the kernel's chunk workspace."""
    v = padded_vocab / tp
    train = 2 * w.dtype_bytes * w.micro_batch * w.seq_len * v
    score = w.dtype_bytes * w.logprob_micro_batch * w.seq_len * v
    work = _CHUNK_BUFFERS * 4 * min(w.chunk, max(w.micro_batch, w.logprob_micro_batch) * w.seq_len) * v
    if train >= score:
        return train + work, f"training micro-batch {w.micro_batch} x {w.seq_len}"
    return score + work, f"scoring micro-batch {w.logprob_micro_batch} x {w.seq_len}"


def kv_bytes_per_token(spec, vllm_tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes of one token on one GPU of a vLLM engine (KV heads are replicated when
    vLLM's TP exceeds their number)."""
    local_kv = max(1, spec.kv_heads // vllm_tp)
    return 2 * spec.num_layers * local_kv * spec.head_dim * dtype_bytes


def vllm_activation_bytes(spec, vllm_tp: int, dtype_bytes: int) -> float:
    """vLLM's profiled forward: ``VLLM_PROFILE_TOKENS`` tokens through one layer's widest
    tensors (residual, norm, QKV, gate/up), sharded over vLLM's TP where they are."""
    h, d = spec.hidden_size, spec.head_dim
    per_token = 4 * h + (2 * spec.ffn_hidden_size + d * (spec.num_heads + 2 * spec.kv_heads)) / vllm_tp
    return VLLM_PROFILE_TOKENS * per_token * dtype_bytes


def megatron_lm_reference(spec, *, padded_vocab: int, tp: int, pp: int, dp: int, b: int, s: int,
                          micro_batches: int, dtype_bytes: int = 2) -> Dict[str, float]:
    """Megatron-LM's theoretical memory (``megatron/training/theoretical_memory_usage.py``,
    the no-sequence-parallel path, distributed optimizer), restated here for comparison:
    the most loaded shard (a stage's layers + one embedding, over TP; both embeddings when
    untied at PP 1) at ``6 + 12/DP`` bytes per parameter, and the first stage's activations
    ``s b h (10 + 24/t)`` per layer for all L layers (1F1B's PP micro-batches of L/PP layers)
    scaled by ``min(1, micro-batches / PP)``, plus the embedding's input and output for PP
    micro-batches, plus (PP 1 only) the logits and final norm output in 2 bytes, all x 1.05.
    It ignores q/k/v biases, GQA and the SwiGLU width in the activations (its own TODO) and
    does not model full recompute."""
    h, F, L = spec.hidden_size, spec.ffn_hidden_size, spec.num_layers
    q_size = spec.head_dim * spec.num_heads
    attn = 2 * h * h * (1 + spec.kv_heads / spec.num_heads) * (q_size / h)
    layer = 2 * h * (F * 1.5 + 1) + attn
    emb = h * padded_vocab
    block = layer * L + h
    most = (block / pp + emb) / tp
    if not spec.tie_word_embeddings and pp == 1:
        most += emb / tp
    weight_opt = most * (6 + 12 / dp)
    act = s * b * h * (10 + 24 / tp) * L
    act += 8 * s * b * pp + s * b * h * pp
    if pp > 1:
        act *= min(1.0, micro_batches / pp)
    else:
        act += (s * b * padded_vocab / tp + s * b * h) * 2
    act *= 1.05
    return {"params_most_loaded_shard": most, "weight_and_optimizer_bytes": weight_opt, "activation_bytes": act}
