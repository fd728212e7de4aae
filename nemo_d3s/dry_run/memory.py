"""The dry run's memory model: what one GPU of a Megatron layout holds, as formulas of the
model's shape and the step's workload (pure arithmetic). Bytes per GPU at (TP rank, PP stage);
P = the position's parameters (padded vocabulary included), N = the model's, d = dtype bytes.

- weights d P; grads 4 P (fp32 reduce); optimizer 12 P / DP (distributed optimizer: fp32 main
  weights + 2 moments; 8 P / DP for fp32 weights; a MoE's expert state 12 P_e / expert DP).
  Plain AdamW: grads 4 P (fp32 main_grad), optimizer 12 P.
- activations: :func:`layer_activation_bytes` x the stage's L / PP layers x the micro-batches
  1F1B keeps in flight (``min(PP - stage, micro-batches)``) x the interleaving factor; full
  recompute keeps each layer's input [s, b, h] plus one layer's full set.
- logits (last stage): :func:`logits_bytes`. reference: d P when ``algorithm.kl_coef > 0``.
- hf_replica d N and hf_kv_cache (``rollout.engine=hf``, first GPU of each TP x PP group).
- cuda_context ``CUDA_CONTEXT_BYTES``, nccl :func:`nccl_bytes`, fragmentation
  ``FRAGMENTATION_SHARE`` of activations + logits (assumed figures: ``ASSUMPTIONS``).
- on GPUs carrying a vLLM worker: vllm = ``gpu_memory_utilization`` x the physical GPU
  (:func:`physical_gpu_bytes`) while generating, its KV cache what weights and profiled
  activations leave; vllm_asleep = what level-2 sleep keeps (all with ``rollout.sleep=false``);
  refit = staging buffer, gathered bucket and the engine's copy.
- context parallelism: each GPU holds 1 / CP of a micro-batch's tokens (activations and
  logits / CP), the optimizer shards over DP x CP, one more communicator; a position that
  fits not even one row with SP and recompute is reported (``context_parallel_needed``).
- nvls :func:`nvls_bytes`: NVLink SHARP's buffers per communicator with 2+ ranks on a node
  (NCCL ``src/transport/nvls.cc`` ``ncclNvlsBufferSetup``), unless ``NCCL_NVLS_ENABLE=0``.
- vllm also counts the context and TP communicator its worker makes before measuring the GPU
  (``backends/vllm/memory.awake_engine_bytes``).

Peaks (resident = weights + grads + optimizer + reference + hf_replica + cuda_context + nccl
+ nvls): training = resident + activations + logits + fragmentation (+ moe_dispatch:
``dry_run/moe.py``) + vllm_asleep;
generation = resident + hf_kv_cache or vllm (the trainer empties its cache before an engine
wakes); refit = resident + vllm_asleep + refit + vLLM weights. The largest is compared with
``trainer.gpu_memory_gb`` (decimal GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from nemo_d3s.dry_run.sequence import interleaving_factor, replicated_share, tokens_per_micro_batch

__all__ = [
    "GB",
    "ASSUMPTIONS",
    "CUDA_CONTEXT_BYTES",
    "FRAGMENTATION_SHARE",
    "NCCL_BUFFSIZE",
    "NCCL_CHANNELS",
    "nccl_bytes",
    "nvls_bytes",
    "nccl_communicators",
    "node_ranks_of_groups",
    "physical_gpu_bytes",
    "VLLM_PROFILE_TOKENS",
    "RESIDENT",
    "TRAINING",
    "GENERATION",
    "Workload",
    "layer_activation_bytes",
    "activation_bytes",
    "logits_bytes",
    "kv_bytes_per_token",
    "vllm_activation_bytes",
    "megatron_lm_reference",
    "minimal_training_bytes",
]

GB = 10**9
# Which memory terms are held when: all the time, while the policy trains, while the engine
# generates.
RESIDENT = (
    "weights",
    "grads",
    "optimizer",
    "reference",
    "hf_replica",
    "cuda_context",
    "nccl",
    "nvls",
)
TRAINING = ("activations", "logits", "fragmentation", "moe_dispatch")
GENERATION = ("hf_kv_cache", "vllm")
CUDA_CONTEXT_BYTES = int(0.6 * GB)  # CUDA context + cuBLAS / cuDNN workspaces (assumed)
NCCL_BUFFSIZE = 4 * 2**20  # NCCL's default NCCL_BUFFSIZE (NCCL user guide, environment variables)
NCCL_CHANNELS = 32  # channels NCCL opens on an NVLink / NVSwitch node at most (assumed)
FRAGMENTATION_SHARE = 0.10  # of the training step's transient allocations (assumed)
NVLS_CHANNELS = 16  # NCCL_NVLS_NCHANNELS on an H100 / H200 NVSwitch node (assumed: its default)
NVLS_BUFFER = 8 * 128 * 2**10  # NCCL_STEPS x NCCL_NVLS_CHUNKSIZE (128 KiB, NCCL's default)
# What NVML reports (nvidia-smi) for GPUs sold by a round decimal size: the memory vLLM's
# gpu_memory_utilization is a share of. thundergolfer.com/blog/nvidia-gpu-memory-capacity
# (H100 80GB: 81,559 MiB = 85.52 GB; H200 141GB: 143,771 MiB; A100 40GB: 40,960 MiB; an
# A100 80GB reports 81,920 MiB, 0.4% more than the H100 figure taken for 80).
PHYSICAL_MIB = {80.0: 81559, 141.0: 143771, 40.0: 40960}
ASSUMPTIONS = {
    "cuda_context_bytes": CUDA_CONTEXT_BYTES,
    "nccl_buffsize_bytes": NCCL_BUFFSIZE,
    "nccl_channels": NCCL_CHANNELS,
    "nvls_channels": NVLS_CHANNELS,
    "nvls_buffer_bytes": NVLS_BUFFER,
    "fragmentation_share_of_training_transients": FRAGMENTATION_SHARE,
    "physical_mib_of_nominal_gb": {str(k): v for k, v in PHYSICAL_MIB.items()},
}
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
    sequence_parallel: bool = False  # model.params.sequence_parallel (at TP > 1)
    micro_batch_tokens: int = 0  # trainer.micro_batch_tokens (0: micro_batch rows)
    logprob_micro_batch_tokens: int = 0  # the scoring pass's budget (resolved)
    vpp: int = 1  # model.params.virtual_pipeline_model_parallel_size (interleaved 1F1B)
    cp: int = 1  # model.params.context_parallel_size: each rank holds 1 / CP of the tokens

    @property
    def train_tokens(self) -> int:
        """Most tokens one training micro-batch feeds one GPU (``dry_run.sequence``; its CP
        share)."""
        t = tokens_per_micro_batch(self.micro_batch, self.seq_len, self.micro_batch_tokens)
        return -(-t // self.cp)

    @property
    def score_tokens(self) -> int:
        t = tokens_per_micro_batch(
            self.logprob_micro_batch, self.seq_len, self.logprob_micro_batch_tokens
        )
        return -(-t // self.cp)


def physical_gpu_bytes(gpu_memory_gb: float) -> int:
    """The physical memory of a ``gpu_memory_gb`` GPU: NVML's total for products sold as that size
    (``PHYSICAL_MIB``), else the figure (decimal GB). vLLM's share is of this total (vLLM 0.33
    ``v1/worker/utils.py:724-726``, total from ``utils/mem_utils.py:143``), not the nominal size.
    """
    mib = PHYSICAL_MIB.get(float(gpu_memory_gb))
    return mib * 2**20 if mib is not None else int(float(gpu_memory_gb) * GB)


def nccl_communicators(
    *, tp: int, pp: int, dp: int, tied_embeddings: bool, cp: int = 1
) -> Dict[str, int]:
    """{group: 1} for each NCCL communicator of more than one rank a trainer rank uses: world, DP,
    DP-with-CP (the distributed optimizer's), TP, PP, CP and the tied-embedding group.
    """
    used = {"world": tp * pp * dp * cp > 1, "dp": dp > 1, "dp_with_cp": dp * cp > 1}
    used.update(tp=tp > 1, pp=pp > 1, cp=cp > 1, embedding=pp > 1 and tied_embeddings)
    return {k: 1 for k, v in used.items() if v}


def nccl_bytes(*, tp: int, pp: int, dp: int, tied_embeddings: bool, cp: int = 1) -> int:
    """GPU memory of the trainer rank's NCCL communicators: two receive buffers (ring, tree) of
    ``NCCL_BUFFSIZE`` per channel over ``NCCL_CHANNELS`` channels: 256 MiB per communicator.
    """
    n = len(nccl_communicators(tp=tp, pp=pp, dp=dp, tied_embeddings=tied_embeddings, cp=cp))
    return n * 2 * NCCL_CHANNELS * NCCL_BUFFSIZE


def node_ranks_of_groups(
    *,
    tp: int,
    pp: int,
    dp: int,
    dp_stride: int,
    pp_stride: int,
    gpus_per_node: int,
    cp: int = 1,
) -> Dict[str, int]:
    """How many ranks of each of rank 0's communicators share its node (every node is laid
    out alike): a group of n ranks ``stride`` apart has min(n, ceil(G / stride)) on a node
    of G GPUs (CP's stride is TP in both of Megatron's orders); the embedding group is the
    first and last stage."""
    g = int(gpus_per_node)

    def on_node(n: int, stride: int) -> int:
        return min(n, -(-g // stride))

    dp_local = on_node(dp, dp_stride)
    # DP x CP: the ranks tp c + dp_stride d (c < CP, d < DP; dp_stride >= tp CP) below G
    dp_cp_local = sum(
        min(cp, -(-(g - d * dp_stride) // tp)) for d in range(dp) if d * dp_stride < g
    )
    return {
        "world": min(tp * pp * dp * cp, g),
        "dp": dp_local,
        "dp_with_cp": dp_cp_local,
        "tp": on_node(tp, 1),
        "pp": on_node(pp, pp_stride),
        "cp": on_node(cp, tp),
        "embedding": 2 if pp > 1 and (pp - 1) * pp_stride < g else 1,
    }


def nvls_bytes(node_ranks: Dict[str, int]) -> int:
    """NVLink SHARP's buffers on one rank for the communicators ``{name: ranks on the
    node}`` (module docstring); a group with one rank on the node uses none."""
    return sum(NVLS_CHANNELS * 2 * NVLS_BUFFER * k for k in node_ranks.values() if k >= 2)


def layer_activation_bytes(
    h: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    *,
    b: int,
    s: int,
    tp: int,
    dtype_bytes: int = 2,
    sequence_parallel: bool = False,
) -> float:
    """Bytes one transformer layer stores for the backward (flash attention, no dropout):
    ``s b d [4 h + (2 d_h (a + g) + 3 F) / TP]`` (a heads, g KV heads, d_h head dim, F FFN): norm
    and linear inputs [s, b, h] replicated over TP (split under sequence parallelism), per TP shard
    q, k, v, the attention output and the SwiGLU input and output. Korthikanti et al. 2022
    (Table 2) re-derived for GQA + SwiGLU without dropout masks.
    """
    per_token = (
        4 * h * replicated_share(tp, sequence_parallel)
        + (2 * head_dim * (heads + kv_heads) + 3 * ffn) / tp
    )
    return s * b * dtype_bytes * per_token


def _layer_bytes(spec, w: Workload, tp: int) -> float:
    return layer_activation_bytes(
        spec.hidden_size,
        spec.num_heads,
        spec.kv_heads,
        spec.head_dim,
        spec.ffn_hidden_size,
        b=1,
        s=w.train_tokens,
        tp=tp,
        dtype_bytes=w.dtype_bytes,
        sequence_parallel=w.sequence_parallel,
    )


def activation_bytes(spec, w: Workload, *, tp: int, pp: int, stage: int) -> Tuple[float, int]:
    """(stored activation bytes of stage ``stage`` under 1F1B, micro-batches in flight)."""
    in_flight = max(1, min(pp - stage, w.micro_batches))
    layers = spec.num_layers // pp
    full = _layer_bytes(spec, w, tp)
    factor = interleaving_factor(pp, w.vpp)  # interleaved 1F1B keeps more in flight
    if not w.recompute:
        return factor * in_flight * layers * full, in_flight
    # each layer's input (the residual stream: split over TP under sequence parallelism)
    kept = (
        w.train_tokens
        * spec.hidden_size
        * w.dtype_bytes
        * replicated_share(tp, w.sequence_parallel)
    )
    return factor * in_flight * layers * kept + full, in_flight


def logits_bytes(padded_vocab: int, w: Workload, *, tp: int) -> Tuple[float, str]:
    """(bytes, which pass) of the last stage's logits [b, s, V_pad / TP]: training (logits and
    gradient) or scoring, the larger, each plus GPTModel's batch-first copy (megatron-core 0.16.1
    ``models/gpt/gpt_model.py:712``: both layouts exist at once), plus the kernel's workspace.
    """
    v = padded_vocab / tp
    train = 3 * w.dtype_bytes * w.train_tokens * v
    score = 2 * w.dtype_bytes * w.score_tokens * v
    work = _CHUNK_BUFFERS * 4 * min(w.chunk, max(w.train_tokens, w.score_tokens)) * v
    if train >= score:
        return (
            train + work,
            f"training micro-batch {_micro_text(w.micro_batch, w.micro_batch_tokens, w.seq_len)}",
        )
    return (
        score + work,
        "scoring micro-batch "
        f"{_micro_text(w.logprob_micro_batch, w.logprob_micro_batch_tokens, w.seq_len)}",
    )


def _micro_text(rows: int, budget: int, seq_len: int) -> str:
    return (
        f"{tokens_per_micro_batch(rows, seq_len, budget)} tokens (budget)"
        if budget
        else f"{rows} x {seq_len}"
    )


def minimal_training_bytes(
    spec, w: Workload, padded_vocab: int, *, tp: int, pp: int, stage: int
) -> float:
    """Activations (+ logits on the last stage) of the smallest training step the backend
    runs: one row per micro-batch, full recompute, sequence parallelism at TP > 1."""
    m = Workload(
        **{
            **w.__dict__,
            "micro_batch": 1,
            "logprob_micro_batch": 1,
            "micro_batch_tokens": 0,
            "logprob_micro_batch_tokens": 0,
            "recompute": True,
            "sequence_parallel": tp > 1,
        }
    )
    act, _ = activation_bytes(spec, m, tp=tp, pp=pp, stage=stage)
    return act + (logits_bytes(padded_vocab, m, tp=tp)[0] if stage == pp - 1 else 0.0)


def kv_bytes_per_token(spec, vllm_tp: int, dtype_bytes: int) -> int:
    """KV-cache bytes of one token on one GPU of a vLLM engine (KV heads are replicated when
    vLLM's TP exceeds their number)."""
    local_kv = max(1, spec.kv_heads // vllm_tp)
    return 2 * spec.num_layers * local_kv * spec.head_dim * dtype_bytes


def vllm_activation_bytes(spec, vllm_tp: int, dtype_bytes: int) -> float:
    """vLLM's profiled forward: ``VLLM_PROFILE_TOKENS`` tokens through one layer's widest
    tensors (residual, norm, QKV, gate/up), sharded over vLLM's TP where they are."""
    h, d = spec.hidden_size, spec.head_dim
    per_token = (
        4 * h + (2 * spec.ffn_hidden_size + d * (spec.num_heads + 2 * spec.kv_heads)) / vllm_tp
    )
    return VLLM_PROFILE_TOKENS * per_token * dtype_bytes


def megatron_lm_reference(
    spec,
    *,
    padded_vocab: int,
    tp: int,
    pp: int,
    dp: int,
    b: int,
    s: int,
    micro_batches: int,
    dtype_bytes: int = 2,
    sequence_parallel: bool = False,
) -> Dict[str, float]:
    """Megatron-LM's theoretical memory (``megatron/training/theoretical_memory_usage.py``,
    distributed optimizer) for comparison: the most loaded shard at ``6 + 12/DP`` bytes per
    parameter and the first stage's activations ``s b h (10 + 24/t)`` per layer (``34 s b h / t``
    with SP), scaled and padded as that file does. It ignores q/k/v biases, GQA, the SwiGLU
    width and full recompute.
    """
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
    act = s * b * h * (34 / tp if sequence_parallel else 10 + 24 / tp) * L
    act += 8 * s * b * pp + s * b * h * pp
    if pp > 1:
        act *= min(1.0, micro_batches / pp)
    else:
        act += (s * b * padded_vocab / tp + s * b * h) * 2
    act *= 1.05
    return {
        "params_most_loaded_shard": most,
        "weight_and_optimizer_bytes": weight_opt,
        "activation_bytes": act,
    }
