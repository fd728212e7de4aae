"""``trainer.dry_run=true``: prove a Megatron layout on a laptop before queueing for it.

``python -m nemo_d3s.train experiment=llama3_70b trainer.dry_run=true`` (with ``NNODES`` and
``GPUS_PER_NODE`` set to the job's shape) resolves the config, checks every divisibility
rule of the layout, builds this model's stage for each distinct (TP, PP) position on the
meta device (no memory, no weights: ``model.name`` may be a folder holding only
``config.json``), and prints, per GPU, the memory the run will need against
``trainer.gpu_memory_gb``, with a verdict and the largest term named. It writes
``output_dir/dry_run.json`` and returns 0 (fits), 1 (does not fit) or raises
:class:`~nemo_d3s.config.ConfigError` (the layout cannot run at all: exit 2 from the CLI).
Nothing is trained, no process group is created, no weight is read. The plan is for CUDA
(``model.dtype=auto`` is bf16 there), wherever the dry run itself runs.

The job's shape: ``NNODES`` x ``GPUS_PER_NODE`` (what ``slurm/train_megatron.sbatch`` exports),
else ``SLURM_JOB_NUM_NODES`` x ``SLURM_GPUS_ON_NODE``, else 1 x 8.

Memory model, per GPU at (TP rank, PP stage), bytes (P = this position's parameters incl.
vocabulary padding, d = bytes of the model dtype: 2 for bf16; DP = data-parallel size):

- weights: d P. grads: 4 P (Megatron DDP reduces in fp32: ``grad_reduce_in_fp32=True``).
- optimizer: Megatron's distributed optimizer shards fp32 main weights + Adam's two moments
  over DP: 12 P / DP (8 P / DP for fp32 weights, which are their own main copy). Together
  with the two lines above this is megatron-core's ``6 + 12/DP`` bytes per parameter.
  With ``model.params.distributed_optimizer=false`` (plain AdamW over each rank's shards):
  grads d P and both moments 2 d P, not sharded over DP.
- activations (flash attention, no dropout: what the backend builds), per layer and
  micro-batch of b rows x s tokens (b s = ``trainer.micro_batch_tokens`` when set, or one
  row of s when that is longer: ``dry_run_sequence.tokens_per_micro_batch``), stored for
  the backward:
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
  recompute's kept inputs are split over TP (``backends/megatron/sequence_parallel.py``).
- context parallelism: when one row of s tokens per micro-batch with full recompute and
  sequence parallelism still does not fit beside the resident state, the report's
  ``context_parallel_needed`` names the position and a problem says that only context
  parallelism would split it further, which megatron-core runs only with Transformer
  Engine's attention (refused by the backend).
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

Cross-checks (recorded in the JSON): the parameters of every (TP, PP) position come from
the weight table (``weights.local_shape``); each distinct position is also BUILT with
megatron-core on the meta device (``backends/megatron/param_counts.py``: a fake process
group of the job's world size, so Megatron's parallel state is that of the position) and its
parameter count compared;
the positions' real (unpadded, tied embedding once, TP-replicated norms once) parameters
sum to the HF model's count; and megatron-core's theoretical memory formula (Megatron-LM
``theoretical_memory_usage``: ``6 + 12/DP`` bytes per parameter on the most loaded shard,
``s b h (10 + 24/t)`` activation bytes per layer) is reported beside this model.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from nemo_d3s.backends.megatron.param_counts import local_param_count, meta_param_counts, real_param_count, stage_positions
from nemo_d3s.backends.megatron.parallel import DEFAULT_ORDER, first_ranks_of_model_copies, rank_order
from nemo_d3s.config import ConfigError
from nemo_d3s.dry_run_sequence import (
    context_parallel_need,
    interleaving_factor,
    micro_batches_per_step,
    replicated_share,
    tokens_per_micro_batch,
)

__all__ = [
    "JobShape",
    "Workload",
    "job_shape",
    "layer_activation_bytes",
    "activation_bytes",
    "logits_bytes",
    "megatron_lm_reference",
    "plan",
    "render",
    "dry_run",
]

GB = 10**9
# Which memory terms are held when: all the time, while the policy trains, while the engine generates.
_RESIDENT = ("weights", "grads", "optimizer", "reference", "hf_replica")
_TRAINING = ("activations", "logits")
_GENERATION = ("hf_kv_cache", "vllm")
RUNTIME_BYTES = 2 * GB  # CUDA context + NCCL communicators + allocator slack (an assumption)
VLLM_PROFILE_TOKENS = 8192  # vLLM profiles one forward of this many batched tokens at start
_CHUNK_BUFFERS = 3  # fp32 [chunk, V/TP] buffers the vocab-parallel kernel holds at once


# ----------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class JobShape:
    nodes: int
    gpus_per_node: int
    source: str  # where the numbers came from, for messages

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def job_shape(env: Optional[Mapping[str, str]] = None) -> JobShape:
    """Nodes x GPUs per node: ``NNODES`` / ``GPUS_PER_NODE``, else Slurm's
    ``SLURM_JOB_NUM_NODES`` / ``SLURM_GPUS_ON_NODE``, else 1 x 8."""
    env = os.environ if env is None else env

    def pick(*names: str, default: int) -> Tuple[int, str]:
        for n in names:
            v = env.get(n)
            if v not in (None, ""):
                try:
                    x = int(v)
                except ValueError:
                    x = 0
                if x < 1:
                    raise ConfigError(f"{n}={v!r}: must be a positive integer")
                return x, f"{n}={x}"
        return default, f"{names[0]}={default} (default)"

    nodes, a = pick("NNODES", "SLURM_JOB_NUM_NODES", default=1)
    gpus, b = pick("GPUS_PER_NODE", "SLURM_GPUS_ON_NODE", default=8)
    return JobShape(nodes, gpus, f"{a} x {b}")


def model_folder(name: str) -> Path:
    """``model.name`` as a folder: as given (relative to the working directory), else
    relative to the folder holding the ``nemo_d3s`` package (the recipes' shipped
    ``nemo_d3s/recipes/<name>`` from any working directory), else the backend's own
    resolution (the embedded short names)."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p.resolve()
    packaged = Path(__file__).resolve().parent.parent / name
    if not p.is_absolute() and packaged.is_dir():
        return packaged
    from nemo_d3s.backends.hf.loading import resolve_model_path

    return Path(resolve_model_path(name)).resolve()


# ----------------------------------------------------------------------------- formulas
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
        """Most tokens one training micro-batch feeds (``dry_run_sequence``)."""
        return tokens_per_micro_batch(self.micro_batch, self.seq_len, self.micro_batch_tokens)

    @property
    def score_tokens(self) -> int:
        return tokens_per_micro_batch(self.logprob_micro_batch, self.seq_len, self.logprob_micro_batch_tokens)


def layer_activation_bytes(h: int, heads: int, kv_heads: int, head_dim: int, ffn: int, *, b: int, s: int,
                           tp: int, dtype_bytes: int = 2, sequence_parallel: bool = False) -> float:
    """Bytes one transformer layer stores for the backward (module docstring); under
    sequence parallelism the replicated ``4 h`` term is split over TP too."""
    per_token = 4 * h * replicated_share(tp, sequence_parallel) + (2 * head_dim * (heads + kv_heads) + 3 * ffn) / tp
    return s * b * dtype_bytes * per_token


def _layer_bytes(spec, w: Workload, tp: int) -> float:
    return layer_activation_bytes(spec.hidden_size, spec.num_heads, spec.kv_heads, spec.head_dim,
                                  spec.ffn_hidden_size, b=1, s=w.train_tokens, tp=tp,
                                  dtype_bytes=w.dtype_bytes, sequence_parallel=w.sequence_parallel)


def activation_bytes(spec, w: Workload, *, tp: int, pp: int, stage: int) -> Tuple[float, int]:
    """(stored activation bytes of stage ``stage`` under 1F1B, micro-batches in flight)."""
    in_flight = max(1, min(pp - stage, w.micro_batches))
    layers = spec.num_layers // pp
    full = _layer_bytes(spec, w, tp)
    factor = interleaving_factor(pp, w.vpp)  # interleaved 1F1B keeps more in flight
    if not w.recompute:
        return factor * in_flight * layers * full, in_flight
    # each layer's input (the residual stream: split over TP under sequence parallelism)
    kept = w.train_tokens * spec.hidden_size * w.dtype_bytes * replicated_share(tp, w.sequence_parallel)
    return factor * in_flight * layers * kept + full, in_flight


def logits_bytes(padded_vocab: int, w: Workload, *, tp: int) -> Tuple[float, str]:
    """(bytes, which pass) of the last stage's logits: training (logits + gradient) or
    scoring (logits only), whichever is larger, plus the kernel's chunk workspace."""
    v = padded_vocab / tp
    train = 2 * w.dtype_bytes * w.train_tokens * v
    score = w.dtype_bytes * w.score_tokens * v
    work = _CHUNK_BUFFERS * 4 * min(w.chunk, max(w.train_tokens, w.score_tokens)) * v
    if train >= score:
        return train + work, f"training micro-batch {_micro_text(w.micro_batch, w.micro_batch_tokens, w.seq_len)}"
    return score + work, f"scoring micro-batch {_micro_text(w.logprob_micro_batch, w.logprob_micro_batch_tokens, w.seq_len)}"


def _micro_text(rows: int, budget: int, seq_len: int) -> str:
    return f"{tokens_per_micro_batch(rows, seq_len, budget)} tokens (budget)" if budget else f"{rows} x {seq_len}"


def _minimal_training_bytes(spec, w: Workload, padded_vocab: int, *, tp: int, pp: int, stage: int) -> float:
    """Activations (+ logits on the last stage) of the smallest training step the backend
    runs: one row per micro-batch, full recompute, sequence parallelism at TP > 1."""
    m = Workload(**{**w.__dict__, "micro_batch": 1, "logprob_micro_batch": 1, "micro_batch_tokens": 0,
                    "logprob_micro_batch_tokens": 0, "recompute": True, "sequence_parallel": tp > 1})
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
    per_token = 4 * h + (2 * spec.ffn_hidden_size + d * (spec.num_heads + 2 * spec.kv_heads)) / vllm_tp
    return VLLM_PROFILE_TOKENS * per_token * dtype_bytes


def megatron_lm_reference(spec, *, padded_vocab: int, tp: int, pp: int, dp: int, b: int, s: int,
                          micro_batches: int, dtype_bytes: int = 2, sequence_parallel: bool = False) -> Dict[str, float]:
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
    return {"params_most_loaded_shard": most, "weight_and_optimizer_bytes": weight_opt, "activation_bytes": act}


# ----------------------------------------------------------------------------- the plan
def _backend_config(cfg):
    """The Megatron backend's typed config from the run config (unknown ``model.params``
    keys and options the backend refuses are errors here too)."""
    from omegaconf import OmegaConf

    from nemo_d3s.backends.megatron.backend import _check_options
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig
    from nemo_d3s.trainer.backend_registry import backend_config

    params = OmegaConf.to_container(cfg.model.params, resolve=True) if OmegaConf.is_config(cfg.model.params) \
        else dict(cfg.model.params or {})
    common = {"model": str(cfg.model.name), "dtype": str(cfg.model.dtype), "device": str(cfg.model.device),
              "gradient_checkpointing": bool(cfg.model.gradient_checkpointing)}
    try:
        mcfg = backend_config(MegatronBackendConfig, common, params)
        _check_options(mcfg)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    return mcfg


def _dtype_bytes(dtype: str) -> int:
    # The plan is for CUDA, where "auto" is bfloat16 (MegatronBackend).
    return {"auto": 2, "bfloat16": 2, "float32": 4}[dtype]


def _workload(cfg, spec, *, dp: int, engines: int, mcfg) -> Workload:
    t = cfg.trainer
    ctx = int(spec.max_position_embeddings)
    vllm = str(cfg.rollout.engine) == "vllm"
    mml = cfg.rollout.max_model_len if vllm else None
    if mml is not None:
        if int(mml) > ctx:
            raise ConfigError(f"rollout.max_model_len={mml}: exceeds the model's context ({ctx} positions); "
                              "vLLM refuses it")
        ctx = int(mml)
    new = int(t.max_new_tokens)
    gen_new = max(new, int(t.eval_max_new_tokens or new))
    limit = cfg.task.max_prompt_tokens
    if limit is None:
        limit = ctx - gen_new
        if limit < 1:
            raise ConfigError(f"trainer.max_new_tokens={gen_new}: leaves no room for a prompt in the context of "
                              f"{ctx} positions")
    elif int(limit) + gen_new > ctx:
        where = "rollout.max_model_len" if mml is not None else "the model's context"
        raise ConfigError(f"task.max_prompt_tokens={limit} + {gen_new} new tokens = {int(limit) + gen_new} exceeds "
                          f"{where} ({ctx}): the longest rollout would not fit")
    rows = int(t.prompts_per_step) * int(t.num_generations)
    per_dp_update = -(-rows // (dp * int(t.num_mini_batches)))
    budget = int(t.micro_batch_tokens)
    lp_budget = budget if t.logprob_micro_batch_tokens is None else int(t.logprob_micro_batch_tokens)
    return Workload(
        seq_len=int(limit) + new,
        gen_len=int(limit) + gen_new,
        micro_batch=int(t.micro_batch_size),
        logprob_micro_batch=int(t.logprob_micro_batch_size),
        micro_batches=micro_batches_per_step(per_dp_update, int(limit) + new, int(t.micro_batch_size), budget),
        rows_per_engine=-(-rows // engines),
        recompute=bool(mcfg.gradient_checkpointing),
        dtype_bytes=_dtype_bytes(str(mcfg.dtype)),
        chunk=int(mcfg.entropy_chunk_size),
        sequence_parallel=bool(mcfg.sequence_parallel) and int(mcfg.tensor_model_parallel_size) > 1,
        micro_batch_tokens=budget,
        logprob_micro_batch_tokens=lp_budget,
        vpp=int(mcfg.virtual_pipeline_model_parallel_size or 1),
    )


def _vllm_placement(shape: JobShape, *, tp: int, pp: int, dp: int, vllm_tp: int, order: str) -> Dict[str, Any]:
    """Engines per node (one per TP x PP group, on its first rank's node) and the shards
    the busiest GPU carries when each node spreads its engines' vLLM-TP workers over its
    GPUs as evenly as it can."""
    per_node: Dict[int, int] = {}
    for r in first_ranks_of_model_copies(tp, pp, dp, order):
        per_node[r // shape.gpus_per_node] = per_node.get(r // shape.gpus_per_node, 0) + 1
    shards = max(-(-n * vllm_tp // shape.gpus_per_node) for n in per_node.values())
    return {"engines": dp, "engines_per_node": {str(k): v for k, v in sorted(per_node.items())},
            "shards_per_gpu": shards}


def plan(cfg: Any, shape: Optional[JobShape] = None) -> Dict[str, Any]:
    """The dry run's report (a JSON-able dict); ConfigError when the layout cannot run."""
    from nemo_d3s.backends.megatron.hf_config import ModelSpec, check_layout, padded_vocab_size
    from nemo_d3s.backends.megatron.weights import Layout
    from nemo_d3s.config import validate, validate_layout

    validate(cfg)
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its import-time notices are not the plan
    if str(cfg.model.backend) != "megatron":
        raise ConfigError(f"model.backend={cfg.model.backend!r}: trainer.dry_run plans Megatron layouts; use "
                          "model=megatron (slurm/README.md says which models fit the HF backend)")
    gpu_gb = cfg.trainer.gpu_memory_gb
    if isinstance(gpu_gb, bool) or not isinstance(gpu_gb, (int, float)) or not gpu_gb > 0:
        raise ConfigError(f"trainer.gpu_memory_gb={gpu_gb!r}: must be > 0 (GB of one GPU)")
    gpu = float(gpu_gb) * GB
    shape = shape or job_shape()
    mcfg = _backend_config(cfg)
    folder = model_folder(str(cfg.model.name))
    spec = ModelSpec.from_folder(folder)
    tp, pp = int(mcfg.tensor_model_parallel_size), int(mcfg.pipeline_model_parallel_size)
    order = rank_order(bool(mcfg.use_tp_pp_dp_mapping))
    try:
        dp = check_layout(spec, tp=tp, pp=pp, world=shape.world)
    except ConfigError as e:
        raise ConfigError(f"{e} (world = {shape.source}; set NNODES and GPUS_PER_NODE to the job's shape)") from None
    validate_layout(cfg, dp)
    vpp = int(mcfg.virtual_pipeline_model_parallel_size or 1)
    if spec.num_layers % (pp * vpp):
        raise ConfigError(f"num_hidden_layers={spec.num_layers} is not divisible by pipeline_model_parallel_size x "
                          f"virtual_pipeline_model_parallel_size = {pp * vpp}")
    vocab = padded_vocab_size(spec.vocab_size, tp, int(mcfg.make_vocab_size_divisible_by))

    engine = str(cfg.rollout.engine)
    vllm_tp = int(cfg.rollout.tensor_parallel_size)
    placement = None
    if engine == "vllm":
        if spec.num_heads % vllm_tp:
            raise ConfigError(f"rollout.tensor_parallel_size={vllm_tp}: does not divide num_attention_heads="
                              f"{spec.num_heads} (vLLM shards the heads)")
        if vllm_tp > shape.gpus_per_node:
            raise ConfigError(f"rollout.tensor_parallel_size={vllm_tp}: exceeds the {shape.gpus_per_node} GPUs of "
                              "a node (the in-process engine spans one node)")
        placement = _vllm_placement(shape, tp=tp, pp=pp, dp=dp, vllm_tp=vllm_tp, order=order)
    w = _workload(cfg, spec, dp=dp, engines=dp, mcfg=mcfg)
    d = w.dtype_bytes
    # The plan is for CUDA, where distributed_optimizer=null means Megatron's.
    distributed_opt = mcfg.distributed_optimizer is not False
    if distributed_opt:  # fp32 grads; fp32 main weights (unless fp32 already) + 2 moments over DP
        grad_per_param, opt_per_param = 4, (12 if d < 4 else 8) / dp
    else:  # plain AdamW over each rank's shards: grads and both moments in the parameter dtype
        grad_per_param, opt_per_param = d, 2 * d
    kl = float(cfg.algorithm.kl_coef) > 0

    vllm_terms: Dict[str, float] = {}
    if engine == "vllm":
        gmu = float(cfg.rollout.gpu_memory_utilization)
        v_dtype = {"auto": d, "bfloat16": 2, "float16": 2, "float32": 4}[str(cfg.rollout.dtype)]
        weights = v_dtype * spec.num_params / vllm_tp
        act = vllm_activation_bytes(spec, vllm_tp, v_dtype)
        kv = gmu * gpu - weights - act
        per_tok = kv_bytes_per_token(spec, vllm_tp, v_dtype)
        tokens = max(0, int(kv // per_tok))
        vllm_terms = {"utilization": gmu, "tensor_parallel_size": vllm_tp, "reserved_bytes": gmu * gpu,
                      "weights_bytes": weights, "activation_bytes": act, "kv_cache_bytes": kv,
                      "kv_bytes_per_token": per_tok, "kv_tokens": tokens,
                      "max_model_len": int(cfg.rollout.max_model_len or spec.max_position_embeddings),
                      "longest_rollout": w.gen_len, "full_sequences": tokens // w.gen_len, "rows_per_engine_step": w.rows_per_engine,
                      "sleep": bool(cfg.rollout.sleep), **(placement or {})}

    problems: List[str] = []
    if engine == "vllm":
        if vllm_terms["kv_cache_bytes"] <= 0:
            problems.append(f"vLLM: rollout.gpu_memory_utilization={vllm_terms['utilization']} x {gpu / GB:g} GB "
                            f"does not hold its weights ({vllm_terms['weights_bytes'] / GB:.1f} GB at vLLM TP "
                            f"{vllm_tp}) and activations: no KV cache")
        elif vllm_terms["kv_tokens"] < vllm_terms["max_model_len"]:
            problems.append(f"vLLM: a KV cache of {vllm_terms['kv_tokens']} tokens cannot hold one sequence of "
                            f"max_model_len={vllm_terms['max_model_len']} (vLLM refuses to start; set "
                            "rollout.max_model_len to the longest rollout)")

    positions = []
    cp_needs: List[Dict[str, Any]] = []  # positions that only context parallelism would fit
    for t, p in stage_positions(tp, pp):
        layout = Layout(tp=tp, pp=pp, tp_rank=t, pp_rank=p, padded_vocab=vocab, te=False)
        n = local_param_count(spec, layout)
        terms: Dict[str, float] = {
            "weights": d * n,
            "grads": grad_per_param * n,
            "optimizer": opt_per_param * n,
        }
        if kl:
            terms["reference"] = d * n
        if engine == "hf" and t == 0 and p == 0:
            terms["hf_replica"] = d * spec.num_params
        act, in_flight = activation_bytes(spec, w, tp=tp, pp=pp, stage=p)
        terms["activations"] = act
        logit_note = None
        if p == pp - 1:
            terms["logits"], logit_note = logits_bytes(vocab, w, tp=tp)
        if "hf_replica" in terms:
            rows = w.rows_per_engine if mcfg.generation_batch_size is None else min(
                w.rows_per_engine, int(mcfg.generation_batch_size))
            terms["hf_kv_cache"] = rows * w.gen_len * kv_bytes_per_token(spec, 1, d)
        if engine == "vllm":
            terms["vllm"] = vllm_terms["shards_per_gpu"] * vllm_terms["reserved_bytes"]
        terms["runtime"] = RUNTIME_BYTES
        resident = sum(v for k, v in terms.items() if k in _RESIDENT) + RUNTIME_BYTES
        train_peak = resident + sum(v for k, v in terms.items() if k in _TRAINING)
        gen_peak = resident + sum(v for k, v in terms.items() if k in _GENERATION)
        if engine == "vllm" and not vllm_terms["sleep"]:
            train_peak += terms["vllm"]  # an engine that does not sleep keeps its memory while the policy trains
        peak = max(train_peak, gen_peak)
        phase = "training" if train_peak >= gen_peak else "generation"
        cp_need = context_parallel_need(resident, _minimal_training_bytes(spec, w, vocab, tp=tp, pp=pp, stage=p), gpu,
                                        seq_len=w.seq_len, position=f"(TP {t}, PP {p})")
        if cp_need is not None:
            cp_needs.append(cp_need)
        counted = {k: v for k, v in terms.items() if k != "runtime"}
        largest = max(counted, key=lambda k: counted[k])
        positions.append({
            "tp_rank": t, "pp_rank": p, "params": n, "real_params": real_param_count(spec, layout),
            "layers": spec.num_layers // pp, "in_flight_micro_batches": in_flight,
            "terms_bytes": {k: int(v) for k, v in terms.items()},
            "train_peak_bytes": int(train_peak), "generation_peak_bytes": int(gen_peak), "peak_bytes": int(peak),
            "peak_phase": phase, "largest_term": largest, "fits": peak <= gpu,
            **({"logits_from": logit_note} if logit_note else {}),
        })

    shards_sum = sum(x["real_params"] for x in positions)
    if shards_sum != spec.num_params:
        raise RuntimeError(f"the per-position shards sum to {shards_sum} parameters, the model has {spec.num_params}")
    meta = meta_param_counts(spec, tp=tp, pp=pp, world=shape.world, padded_vocab=vocab, order=order)
    for key, n in meta.get("counts", {}).items():
        t, p = (int(x) for x in key.split(","))
        want = next(x["params"] for x in positions if (x["tp_rank"], x["pp_rank"]) == (t, p))
        if n != want:
            raise RuntimeError(f"position (TP {t}, PP {p}): megatron-core builds {n} parameters, the weight table "
                               f"says {want}")

    worst = max(positions, key=lambda x: x["peak_bytes"])
    fits = all(x["fits"] for x in positions) and not problems
    state_keys = ("weights", "grads", "optimizer", "reference")  # the training state, without rollouts
    heaviest = max(positions, key=lambda x: sum(x["terms_bytes"].get(k, 0) for k in state_keys))
    state = {k: heaviest["terms_bytes"][k] for k in state_keys if k in heaviest["terms_bytes"]}
    if sum(state.values()) > gpu:
        problems.insert(0, f"the training state alone needs {sum(state.values()) / GB:.1f} GB per GPU at (TP "
                           f"{heaviest['tp_rank']}, PP {heaviest['pp_rank']}) ("
                           + " + ".join(f"{k} {v / GB:.1f}" for k, v in state.items())
                           + f") > trainer.gpu_memory_gb={gpu / GB:g}: shard the model over more GPUs "
                           "(tensor/pipeline_model_parallel_size)")
    if cp_needs:
        problems.append(cp_needs[0]["message"])
    if not all(x["fits"] for x in positions):
        problems.append(f"(TP {worst['tp_rank']}, PP {worst['pp_rank']}) needs {worst['peak_bytes'] / GB:.1f} GB "
                           f"in {worst['peak_phase']} > trainer.gpu_memory_gb={gpu / GB:g}; largest term: "
                           f"{worst['largest_term']} ({worst['terms_bytes'][worst['largest_term']] / GB:.1f} GB)")
    ref = megatron_lm_reference(spec, padded_vocab=vocab, tp=tp, pp=pp, dp=dp, b=1, s=w.train_tokens,
                                micro_batches=w.micro_batches, dtype_bytes=d, sequence_parallel=w.sequence_parallel)
    first = max((x for x in positions if x["pp_rank"] == 0), key=lambda x: x["params"])
    mine_wo = sum(first["terms_bytes"][k] for k in ("weights", "grads", "optimizer"))
    no_recompute = Workload(**{**w.__dict__, "recompute": False})
    mine_act, _ = activation_bytes(spec, no_recompute, tp=tp, pp=pp, stage=0)
    return {
        "model": {"name": str(cfg.model.name), "folder": str(folder), "architecture": spec.architecture,
                  "total_params": spec.num_params, "vocab_size": spec.vocab_size, "padded_vocab": vocab,
                  "layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
                  "kv_heads": spec.kv_heads, "ffn": spec.ffn_hidden_size,
                  "tie_word_embeddings": spec.tie_word_embeddings},
        "total_params": spec.num_params,
        "fits": fits,
        "problems": problems,
        "gpu_memory_gb": gpu / GB,
        "layout": {"nodes": shape.nodes, "gpus_per_node": shape.gpus_per_node, "world": shape.world,
                   "world_from": shape.source, "tp": tp, "pp": pp, "dp": dp, "rank_order": order,
                   "optimizer": "distributed" if distributed_opt else "plain AdamW", "rollout_engine": engine,
                   "vllm_tp": vllm_tp if engine == "vllm" else None, "dtype_bytes": d,
                   "prompts_per_dp_rank": int(cfg.trainer.prompts_per_step) // dp},
        "workload": dict(w.__dict__),
        "positions": positions,
        "worst": {"tp_rank": worst["tp_rank"], "pp_rank": worst["pp_rank"], "peak_bytes": worst["peak_bytes"],
                  "phase": worst["peak_phase"], "largest_term": worst["largest_term"]},
        "vllm": vllm_terms or None,
        "context_parallel_needed": cp_needs,
        "checks": {
            "shards_sum_params": shards_sum,
            "meta_build": meta,
            "megatron_lm_reference": {
                **{k: int(v) for k, v in ref.items()},
                "this_model_first_stage_weight_grad_optimizer_bytes": mine_wo,
                "this_model_first_stage_activation_bytes_no_recompute": int(mine_act),
                "note": "the same 6 + 12/DP bytes per parameter; the shard differs only because Megatron-LM "
                        "divides the TP-replicated norms by TP and leaves out q/k/v biases. Activations: "
                        "s b h (10 + 24/t) per layer there vs s b (4 h + (2 d_h (a + g) + 3 F)/t) here (GQA, "
                        "SwiGLU, no dropout masks), x 1.05 there, logits counted only at PP 1 there",
            },
        },
    }


# ----------------------------------------------------------------------------- output
_COLUMNS = ("weights", "grads", "optimizer", "reference", "activations", "logits", "hf_replica", "hf_kv_cache",
            "runtime", "vllm")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n:,}"


def render(report: Dict[str, Any]) -> str:
    """The per-GPU table (one row per pipeline stage and set of TP ranks with equal
    numbers; GB = 1e9 bytes) and the verdict."""
    lay, m = report["layout"], report["model"]
    cols = [c for c in _COLUMNS if any(c in x["terms_bytes"] for x in report["positions"])]
    lines = [
        f"dry run: {m['architecture']} {_count(m['total_params'])} params ({m['folder']})",
        f"layout: {lay['nodes']} node(s) x {lay['gpus_per_node']} GPUs = {lay['world']} ({lay['world_from']}); "
        f"TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']}"
        f"{'' if lay.get('rank_order', DEFAULT_ORDER) == DEFAULT_ORDER else ' (ranks ' + lay['rank_order'] + ')'}"
        f"; rollout={lay['rollout_engine']}"
        + (f" (vLLM TP {lay['vllm_tp']})" if lay["vllm_tp"] else ""),
    ]
    w = report["workload"]
    micro = (f"token budget {w['micro_batch_tokens']} (rows up to {w['seq_len']} tokens)" if w.get("micro_batch_tokens")
             else f"micro-batch {w['micro_batch']} x {w['seq_len']} tokens")
    lines.append(f"workload: {micro}, {w['micro_batches']} "
                 f"micro-batches per DP rank, recompute={'full' if w['recompute'] else 'off'}, "
                 f"sequence parallel={'on' if w.get('sequence_parallel') else 'off'}, {w['dtype_bytes']}-byte weights")
    head = ["stage", "tp", "params"] + cols + ["train", "generate", "peak", "largest", "fits"]
    rows: List[List[str]] = []
    groups: Dict[Tuple, List[dict]] = {}
    for x in report["positions"]:
        key = (x["pp_rank"], x["params"], tuple(sorted(x["terms_bytes"].items())))
        groups.setdefault(key, []).append(x)
    for (p, _, _), xs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0]["tp_rank"])):
        x = xs[0]
        tps = [y["tp_rank"] for y in xs]
        tp_text = str(tps[0]) if len(tps) == 1 else f"{tps[0]}-{tps[-1]}"
        rows.append([str(p), tp_text, _count(x["params"])]
                    + [f"{x['terms_bytes'][c] / GB:.1f}" if c in x["terms_bytes"] else "-" for c in cols]
                    + [f"{x['train_peak_bytes'] / GB:.1f}", f"{x['generation_peak_bytes'] / GB:.1f}",
                       f"{x['peak_bytes'] / GB:.1f}", x["largest_term"], "yes" if x["fits"] else "NO"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines.append("per GPU, GB:")
    for r in [head, *rows]:
        lines.append("  " + "  ".join(c.rjust(wd) for c, wd in zip(r, widths)))
    v = report["vllm"]
    if v:
        lines.append(f"vLLM: {v['engines']} engine(s) of TP {v['tensor_parallel_size']}, {v['shards_per_gpu']} per "
                     f"busiest GPU; each GPU of an engine: {v['reserved_bytes'] / GB:.1f} GB reserved = "
                     f"{v['weights_bytes'] / GB:.1f} weights + {v['activation_bytes'] / GB:.1f} activations + "
                     f"{v['kv_cache_bytes'] / GB:.1f} KV cache ({v['kv_tokens']} tokens, {v['full_sequences']} "
                     f"sequences of {v['longest_rollout']}; {v['rows_per_engine_step']} rollouts per engine per step)")
    meta = report["checks"]["meta_build"]
    if "counts" in meta:
        built = ", ".join("(TP {}, PP {})".format(*k.split(",")) for k in meta["built"])
        lines.append(f"checks: megatron-core built {built} on the meta device with the "
                     f"table's parameter counts; shards sum to {report['checks']['shards_sum_params']:,} = the HF "
                     "model's count")
    else:
        lines.append(f"checks: meta-device build skipped ({meta['skipped']}); shards sum to "
                     f"{report['checks']['shards_sum_params']:,} = the HF model's count")
    wk = report["worst"]
    verdict = "FITS" if report["fits"] else "DOES NOT FIT"
    lines.append(f"verdict: {verdict} in {report['gpu_memory_gb']:g} GB per GPU: peak {wk['peak_bytes'] / GB:.1f} GB at "
                 f"(TP {wk['tp_rank']}, PP {wk['pp_rank']}) in {wk['phase']}, largest term {wk['largest_term']}")
    for prob in report["problems"]:
        lines.append(f"  problem: {prob}")
    return "\n".join(lines)


def dry_run(cfg: Any) -> int:
    """Run the dry run for a resolved config: print the table, write
    ``output_dir/dry_run.json``; 0 when it fits, 1 when it does not (ConfigError when the
    layout cannot run at all)."""
    from nemo_d3s.trainer.rundir import check_output_dir

    out = check_output_dir(str(cfg.output_dir))
    report = plan(cfg)
    print(render(report), flush=True)
    tmp = out / f".dry_run.json.tmp-{os.getpid()}"  # a reader never sees half a file
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "dry_run.json")
    print(f"wrote {out / 'dry_run.json'}", flush=True)
    return 0 if report["fits"] else 1
