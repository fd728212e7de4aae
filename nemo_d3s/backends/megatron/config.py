"""Typed configuration of the Megatron backend (``model.backend=megatron``; backend-specific
keys go in ``model.params`` under Megatron's own names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_d3s.core.checks import is_count
from nemo_d3s.backends.hf.gguf_convert import DEFAULT_MODEL_NAME
from nemo_d3s.backends.settings import PolicySettings

__all__ = [
    "DISPATCHERS",
    "DTYPES",
    "MegatronBackendConfig",
    "ROUTER_DTYPES",
    "TRANSFORMER_IMPLS",
    "check_options",
]

DTYPES = ("float32", "bfloat16")  # parameter dtypes besides "auto"
# Megatron-LM's --transformer-impl names (its "inference_optimized" is not offered).
TRANSFORMER_IMPLS = ("transformer_engine", "local")
# megatron-core's token dispatchers that run on gloo and NCCL alike ("flex" needs DeepEP).
DISPATCHERS = ("alltoall", "allgather")
ROUTER_DTYPES = ("fp32", "fp64")  # Megatron-LM's --moe-router-dtype; None: the model's


# Why context parallelism and packed sequences are refused (the backend's error and the dry
# run's report). megatron-core 0.16.1's local attention (transformer/dot_product_attention.py)
# asserts context_parallel_size == 1 (line 57) and packed_seq_params is None (line 153):
# both run only in Transformer Engine's TEDotProductAttention.
CONTEXT_PARALLEL_REFUSAL = (
    "megatron-core runs context parallelism and packed (THD) sequences only through "
    "Transformer Engine's attention (TEDotProductAttention with PackedSeqParams), which "
    "this backend does not build; use model.params.sequence_parallel=true with "
    "tensor_model_parallel_size > 1, model.gradient_checkpointing=true, "
    "trainer.micro_batch_tokens (length-aware micro-batches) or more pipeline stages "
    "instead"
)


@dataclass
class MegatronBackendConfig(PolicySettings):
    """Everything :class:`~nemo_d3s.backends.megatron.backend.MegatronBackend` needs.

    model: a local Hugging Face folder (Llama / Mistral / Qwen2 / Qwen3 config.json +
        safetensors), a folder converted by ``nemo-d3s-convert hf-to-megatron``, a NeMo 2
        checkpoint (``weights/`` + ``context/``), a Megatron-LM / Megatron-Bridge save folder
        (or one ``iter_XXXXXXX/``), or the embedded "smollm2-135m-instruct".
    dtype: parameter dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32",
        "bfloat16". On CUDA, bf16 parameters train through Megatron's distributed optimizer
        with fp32 main weights and optimizer state; the plain path (``distributed_optimizer
        =false``) keeps fp32 main weights and moments too (``main_weights.MainWeightsAdamW``),
        unsharded; fp32 parameters are their own main weights.
    device: "auto" (CUDA when available), "cpu" or "cuda".
    tensor_model_parallel_size / pipeline_model_parallel_size: Megatron's TP and PP; DP =
        world size / (TP x PP). TP must divide the attention heads, the key/value heads and
        the FFN width; PP must divide the layers.
    sequence_parallel: Megatron's sequence parallelism at TP > 1 (activations outside the
        tensor-parallel matmuls split along the sequence over TP; no effect at TP 1); see
        ``sequence_parallel.py``.
    virtual_pipeline_model_parallel_size: > 1 (with PP > 1; layers divisible by PP x VPP):
        megatron-core's interleaved 1F1B, that many model chunks per stage
        (``model.virtual_layouts``). None / 1: plain 1F1B.
    context_parallel_size, sequence_packing: accepted so a recipe can state them; only
        1 / false run and anything else is refused at start-up by name: megatron-core runs
        context parallelism and packed (THD) rows only through Transformer Engine's
        attention (:data:`CONTEXT_PARALLEL_REFUSAL` says what to use instead; the dry run
        reports a layout that would need them).
    use_tp_pp_dp_mapping: Megatron-LM's option of that name: global ranks are laid out
        tp-cp-ep-pp-dp instead of Megatron's default tp-cp-ep-dp-pp, so each TP x PP model
        copy sits on consecutive ranks (whole nodes when TP x PP is a multiple of the GPUs
        per node). The rollout engine of each copy starts on the copy's first rank: at TP4 x
        PP4 on 8-GPU nodes each copy then holds two whole nodes and the engines start one per
        even node, instead of two per node on the first two nodes (the 70B recipe uses it).
        The math is the same in either order; only the groups' members change.
    make_vocab_size_divisible_by: the embedding is padded to a multiple of this x TP
        (Megatron's rule); padded rows are never scored, sampled or exported.
    distributed_optimizer: true: Megatron's DistributedDataParallel + distributed optimizer
        (fp32 main params and Adam state sharded over DP). false: plain AdamW over each
        rank's shards with an explicit DP gradient all-reduce (optimizer state not sharded
        over DP). Both take the HF backend's update math (AdamW, decay on every parameter,
        clipping on the global norm). null (default): true on CUDA, false on CPU; true on
        CPU runs Megatron's classes on gloo through ``cpu_compat`` (how the tests check that
        path). A checkpoint written with either resumes with either, at any layout.
    verify_checksums: a converted or NeMo 2 checkpoint given as ``model`` that carries
        ``checksums.json`` is checked against it before use (every file read once; a
        mismatch is an error naming the file); false skips the check.
    transformer_impl: Megatron-LM's ``--transformer-impl``: "transformer_engine" (default)
        builds the Transformer Engine layer spec on CUDA, and a TE that does not import is
        a start-up error naming the import error; "local" asks for megatron-core's own
        modules by name (unfused attention). The CPU always takes the local spec.
    expert_model_parallel_size / expert_tensor_parallel_size: Megatron's EP (experts split
        over EP ranks carved out of DP) and ETP (each expert's FFN split like a dense MLP
        over TP; None = TP, Megatron's default), mixture-of-experts models only; the
        experts must divide by EP and ETP x EP x PP the world (``formats.spec``).
    moe_token_dispatcher_type: "alltoall" (default) or "allgather", megatron-core's token
        dispatchers (both run on gloo through ``cpu_compat``).
    moe_router_dtype: the router's matmul and softmax dtype: "fp32" (default), "fp64" or
        None (the model's dtype).
    moe_aux_loss_coeff / moe_z_loss_coeff: the router's load-balancing (megatron-core's
        per-micro-batch "aux_loss") and z-loss coefficients, logged per step as
        ``moe_load_balancing_loss`` / ``moe_z_loss`` when > 0. RL default 0 for both: the
        policy gradient alone moves the router, as NeMo-RL's Megatron GRPO configs do
        (``moe_router_load_balancing_type: "none"``, its comment: a sequence aux loss made the
        log-prob error diverge in GRPO; examples/configs/grpo_math_1B_megatron.yaml) and as
        Megatron-Bridge's Qwen3-MoE bridge in verl ("none", "default None for RL"); the
        pretrained router is already balanced, and an auxiliary gradient would change the
        policy the rollouts were sampled from in a way no advantage accounts for.
    entropy_chunk_size: rows of the [b L, V/TP] logits the fused vocab-parallel
        entropy/log-prob kernel handles at once (bounds its workspace).
    The shared settings (:class:`~nemo_d3s.backends.settings.PolicySettings`): the same
        optimizer and LR schedule as the HF backend, clipping on the global norm across
        TP x PP x DP; gradient_checkpointing = Megatron's full recompute, one layer at a
        time; the HF engine's sampling settings (``rollout.engine=hf``: it samples from a
        full copy of the weights on the first rank of each model-parallel group and sends
        the rollouts to the group's other ranks; seeded sampler only).
    """

    model: str = DEFAULT_MODEL_NAME
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    sequence_packing: bool = False  # packed (THD) rows: refused, see CONTEXT_PARALLEL_REFUSAL
    use_tp_pp_dp_mapping: bool = False
    make_vocab_size_divisible_by: int = 128
    entropy_chunk_size: int = 1024
    distributed_optimizer: Optional[bool] = None
    verify_checksums: bool = True
    transformer_impl: str = "transformer_engine"
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_dtype: Optional[str] = "fp32"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0


def check_options(cfg: MegatronBackendConfig) -> None:
    """Refuse what the backend cannot run: Megatron options it accepts by name but does not
    implement yet, a dtype or sampler it does not take. ValueError naming the key; the
    backend, ``trainer.backend_registry.checked_config`` and the dry run call it."""
    vpp = cfg.virtual_pipeline_model_parallel_size
    if vpp is not None and not is_count(vpp, 1):
        raise ValueError(
            f"model.params.virtual_pipeline_model_parallel_size={vpp!r}: an integer >= 1 or None"
        )
    if vpp not in (None, 1) and int(cfg.pipeline_model_parallel_size) < 2:
        raise ValueError(
            f"model.params.virtual_pipeline_model_parallel_size={vpp}: interleaved 1F1B needs "
            "pipeline_model_parallel_size > 1"
        )
    cp = cfg.context_parallel_size
    if not is_count(cp, 1):  # not a TE question
        raise ValueError(
            f"model.params.context_parallel_size={cp!r}: must be 1 (a parallel size is an "
            "integer >= 1, and this backend runs without context parallelism)"
        )
    if cfg.context_parallel_size != 1:
        raise ValueError(
            f"model.params.context_parallel_size={cfg.context_parallel_size}: "
            f"{CONTEXT_PARALLEL_REFUSAL}"
        )
    if cfg.sequence_packing:
        raise ValueError(f"model.params.sequence_packing=true: {CONTEXT_PARALLEL_REFUSAL}")
    if cfg.dtype not in ("auto", *DTYPES):
        raise ValueError(
            f"model.dtype={cfg.dtype!r}: the Megatron backend takes auto, float32 or bfloat16"
        )
    if cfg.sampler != "seeded":
        raise ValueError(
            f"model.params.sampler={cfg.sampler!r}: the Megatron backend's HF engine samples with "
            "the seeded sampler only"
        )
    if cfg.transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"model.params.transformer_impl={cfg.transformer_impl!r}: expected one of "
            f"{', '.join(TRANSFORMER_IMPLS)}"
        )
    if cfg.moe_token_dispatcher_type not in DISPATCHERS:
        raise ValueError(
            f"model.params.moe_token_dispatcher_type={cfg.moe_token_dispatcher_type!r}: "
            f"expected one of {', '.join(DISPATCHERS)}"
        )
    if cfg.moe_router_dtype is not None and cfg.moe_router_dtype not in ROUTER_DTYPES:
        raise ValueError(
            f"model.params.moe_router_dtype={cfg.moe_router_dtype!r}: expected one of "
            f"{', '.join(ROUTER_DTYPES)} or null"
        )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ValueError(f"model.params.{key}={v!r}: a number >= 0")
    if cfg.make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"model.params.make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by} "
            "must be >= 1"
        )
