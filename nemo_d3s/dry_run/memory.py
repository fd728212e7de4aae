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
- activations (flash attention, no dropout: what the backend builds), per layer and
  micro-batch of b rows x s tokens (b s = ``trainer.micro_batch_tokens`` when set, or one
  row of s when that is longer: ``sequence.tokens_per_micro_batch``), stored for the
  backward:
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
  With ``model.params.sequence_parallel=true`` (TP > 1) the replicated ``4 h`` term and the
  recompute's kept inputs are split over TP (``backends/megatron/sequence_parallel.py``);
  interleaved 1F1B (``virtual_pipeline_model_parallel_size`` > 1) multiplies the in-flight
  activations by ``1 + (PP - 1) / (PP VPP)`` (``sequence.interleaving_factor``).
- context parallelism: when one row of s tokens per micro-batch with full recompute and
  sequence parallelism still does not fit beside the resident state, the plan reports the
  position (``context_parallel_needed``): only context parallelism would split it further,
  which megatron-core runs only with Transformer Engine's attention (refused here).
- logits (last stage): the [b, s, V_pad / TP] logits of one micro-batch in the model dtype,
  kept for the backward, plus their gradient, plus GPTModel's batch-first copy (3 d bytes per
  element), or the scoring pass's ``logprob_micro_batch_size`` rows and their copy (2 d bytes
  per element), whichever is larger, plus the vocab-parallel kernel's fp32 chunk workspace
  (3 buffers of ``entropy_chunk_size x V_pad / TP``).
- reference: d P when ``algorithm.kl_coef > 0`` (a frozen copy of the stage).
- hf_replica (``rollout.engine=hf`` only, on the first GPU of each TP x PP group): the HF
  sampler's full copy of the model, d N; hf_kv_cache: its KV cache for the rows it
  generates at once (all of its group's rollouts, or ``generation_batch_size``).
- cuda_context: the trainer process's CUDA context and library workspaces,
  ``CUDA_CONTEXT_BYTES`` (assumed; the same figure as a vLLM worker's context).
- nccl: the buffers of each NCCL communicator the trainer rank uses (:func:`nccl_bytes`):
  two receive buffers of ``NCCL_BUFFSIZE`` (NCCL's default, 4 MiB) per channel (ring and
  tree), over ``NCCL_CHANNELS`` channels, per communicator: the world (barriers, small
  sums), DP and Megatron's DP-with-CP group (the distributed optimizer's reduce-scatter),
  TP, PP (1F1B's point-to-point) and the embedding group (PP > 1, tied embeddings) where
  those have more than one rank. NVLink SHARP and user-buffer registration are not modelled.
- fragmentation: what the caching allocator reserves and cannot reuse, a share
  (``FRAGMENTATION_SHARE``, assumed) of the training step's transient allocations
  (activations + logits), held in the training peak only (the trainer empties its cache
  before an engine wakes). The self-check's ``gpu.peak_memory`` records the reserved and
  allocated peaks on a GPU.
- vllm (``rollout.engine=vllm``, colocated; ``backends/vllm/placement.py`` and
  ``backends/vllm/memory.py``): one engine per TP x PP copy, started on the copy's first
  rank, on that rank's GPU and the next vLLM-TP - 1 GPUs of its node (a layout where two
  engines would share a GPU is an error). Only the positions whose GPU carries an engine
  worker get these terms: vllm = ``gpu_memory_utilization`` x the GPU's PHYSICAL memory
  (vLLM 0.33 ``v1/worker/utils.py:724-726``: ``total_memory x gpu_memory_utilization``, the
  total from ``torch.accelerator.get_memory_info``, ``utils/mem_utils.py:143``; not
  ``trainer.gpu_memory_gb``: :func:`physical_gpu_bytes`) while it generates (its weights
  d N / vLLM-TP, its profiled activations and the KV cache); vllm_asleep = what it keeps
  while the policy trains (level-2 sleep: CUDA context, TP communicator, CUDA graphs; all of
  vllm when ``rollout.sleep=false``); refit = the trainer's staging buffer, the bucket's
  gathered tensors and the next gather's TP shards, and the engine's copy of the bucket out
  of the staging buffer (its receiver copies, so it never keeps a view into a buffer the
  trainer refills), while the engine's weights are awake for a refit. KV budget per GPU =
  utilization x physical GPU - vLLM weights - vLLM activations (``8192`` batched tokens
  profiled); vLLM refuses to start when it cannot hold one ``max_model_len`` sequence.

Peaks (resident = weights + grads + optimizer + reference + hf_replica + cuda_context +
nccl): training = resident + activations + logits + fragmentation + vllm_asleep;
generation = resident + hf_kv_cache or vllm
(every trainer rank on an engine's GPUs empties its CUDA cache before the engine wakes, so
the last update's activations are not still reserved); refit = resident + vllm_asleep +
refit + vLLM's weights. The verdict compares the largest with ``trainer.gpu_memory_gb``
(decimal GB).
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
RESIDENT = ("weights", "grads", "optimizer", "reference", "hf_replica", "cuda_context", "nccl")
TRAINING = ("activations", "logits", "fragmentation", "moe_dispatch")
GENERATION = ("hf_kv_cache", "vllm")
CUDA_CONTEXT_BYTES = int(0.6 * GB)  # CUDA context + cuBLAS / cuDNN workspaces (assumed)
NCCL_BUFFSIZE = 4 * 2**20  # NCCL's default NCCL_BUFFSIZE (NCCL user guide, environment variables)
NCCL_CHANNELS = 32  # channels NCCL opens on an NVLink / NVSwitch node at most (assumed)
FRAGMENTATION_SHARE = 0.10  # of the training step's transient allocations (assumed)
# What NVML reports (nvidia-smi) for GPUs sold by a round decimal size: the memory vLLM's
# gpu_memory_utilization is a share of. thundergolfer.com/blog/nvidia-gpu-memory-capacity
# (H100 80GB: 81,559 MiB = 85.52 GB; H200 141GB: 143,771 MiB; A100 40GB: 40,960 MiB; an
# A100 80GB reports 81,920 MiB, 0.4% more than the H100 figure taken for 80).
PHYSICAL_MIB = {80.0: 81559, 141.0: 143771, 40.0: 40960}
ASSUMPTIONS = {
    "cuda_context_bytes": CUDA_CONTEXT_BYTES,
    "nccl_buffsize_bytes": NCCL_BUFFSIZE,
    "nccl_channels": NCCL_CHANNELS,
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

    @property
    def train_tokens(self) -> int:
        """Most tokens one training micro-batch feeds (``dry_run.sequence``)."""
        return tokens_per_micro_batch(self.micro_batch, self.seq_len, self.micro_batch_tokens)

    @property
    def score_tokens(self) -> int:
        return tokens_per_micro_batch(
            self.logprob_micro_batch, self.seq_len, self.logprob_micro_batch_tokens
        )


def physical_gpu_bytes(gpu_memory_gb: float) -> int:
    """The GPU's physical memory for ``trainer.gpu_memory_gb``: NVML's total for the products
    sold as that many GB (``PHYSICAL_MIB``), else the figure itself (decimal GB). CUDA's
    total (what vLLM reads) can be a few hundred MiB below NVML's; the self-check records it."""
    mib = PHYSICAL_MIB.get(float(gpu_memory_gb))
    return mib * 2**20 if mib is not None else int(float(gpu_memory_gb) * GB)


def nccl_communicators(*, tp: int, pp: int, dp: int, tied_embeddings: bool) -> Dict[str, int]:
    """{group: 1} for each NCCL communicator a trainer rank uses (module docstring)."""
    used = {"world": tp * pp * dp > 1, "dp": dp > 1, "dp_with_cp": dp > 1, "tp": tp > 1}
    used.update(pp=pp > 1, embedding=pp > 1 and tied_embeddings)
    return {k: 1 for k, v in used.items() if v}


def nccl_bytes(*, tp: int, pp: int, dp: int, tied_embeddings: bool) -> int:
    """GPU memory of the trainer rank's NCCL communicators: per communicator and channel, two
    receive buffers of ``NCCL_BUFFSIZE`` (the ring's and the tree's connection; a buffer
    lives on the receiving rank), over ``NCCL_CHANNELS`` channels: 2 x 32 x 4 MiB = 256 MiB
    per communicator."""
    n = len(nccl_communicators(tp=tp, pp=pp, dp=dp, tied_embeddings=tied_embeddings))
    return n * 2 * NCCL_CHANNELS * NCCL_BUFFSIZE


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
    """Bytes one transformer layer stores for the backward (module docstring); under
    sequence parallelism the replicated ``4 h`` term is split over TP too."""
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
    """(bytes, which pass) of the last stage's logits: training (logits + gradient) or
    scoring (logits only), whichever is larger, each plus the copy GPTModel makes when it
    returns them batch-first (``logits.transpose(0, 1).contiguous()``, megatron-core 0.16.1
    ``models/gpt/gpt_model.py:712``: both layouts exist at once, and again for the gradient),
    plus the kernel's chunk workspace."""
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
    distributed optimizer), restated here for comparison:
    the most loaded shard (a stage's layers + one embedding, over TP; both embeddings when
    untied at PP 1) at ``6 + 12/DP`` bytes per parameter, and the first stage's activations
    ``s b h (10 + 24/t)`` per layer (``34 s b h / t`` with sequence parallelism) for all L
    layers (1F1B's PP micro-batches of L/PP layers)
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
