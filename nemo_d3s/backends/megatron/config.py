"""Typed configuration of the Megatron backend (``model.backend=megatron``; backend-specific
keys go in ``model.params`` under Megatron's own names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_d3s.core.checks import is_count, is_number
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


@dataclass
class MegatronBackendConfig(PolicySettings):
    """Everything :class:`~nemo_d3s.backends.megatron.backend.MegatronBackend` needs.

    model: an HF folder, a converted Megatron folder, a NeMo 2 or Megatron-LM / Bridge save,
        or the embedded "smollm2-135m-instruct". dtype: "auto" = fp32 on CPU, bf16 on CUDA
        (bf16 parameters always train on fp32 main weights and moments).
    TP must divide the heads, KV heads and FFN width; PP the layers; VPP > 1 (PP > 1) runs
        interleaved 1F1B. context_parallel_size: CP, DP = world / (TP x PP x CP), each row
        cut into 2 x CP chunks (``core.context_parallel``); each CP rank's TP x PP group has an
        engine and generates a block of the copy's prompts (``cp_rollouts.py``).
        sequence_packing: refused, naming ``trainer.pack_sequences``.
    use_tp_pp_dp_mapping: ranks laid out tp-cp-ep-pp-dp, so each model copy (and its
        engine) sits on consecutive ranks; the math is unchanged.
    rollout_engines_per_copy: E rollout engines per TP x PP group (default 1): the group's
        ranks, ascending, cut into E blocks, an engine on each block's first rank generating a
        contiguous 1/E of the group's prompts (seeded per prompt: the rollouts one engine
        would sample); every engine is refitted from the whole group, one after another. For a
        copy over two nodes (70B at TP 4 x PP 4, vLLM TP 8): 2 puts an engine on each node, so
        no GPU waits while the engines generate.
    distributed_optimizer: Megatron's DDP + distributed optimizer (None: CUDA only) or
        plain AdamW over this rank's shards; checkpoints resume across both and any layout.
    transformer_impl: "transformer_engine" (an import failure is an error) or "local"; the
        CPU always takes the local spec. entropy_chunk_size: rows of the [b L, V/TP]
        logits the vocab-parallel kernel takes at once. width_quantum: micro-batch widths
        are multiples of it (0: exact), bounding the shapes a run feeds.
    expert_model_parallel_size / expert_tensor_parallel_size: Megatron's EP (carved out of
        DP) and ETP (None: TP), mixture-of-experts models only (``formats.spec`` checks them).
        moe_token_dispatcher_type: "alltoall" or "allgather"; moe_router_dtype: "fp32",
        "fp64" or None (the model's).
    moe_aux_loss_coeff / moe_z_loss_coeff: the router's load-balancing and z losses over the
        real tokens (``router_losses``), logged per step when > 0. RL default 0: the policy
        gradient alone moves the router, as in NeMo-RL's Megatron GRPO configs
        (``moe_router_load_balancing_type: "none"``: an aux loss made the log-prob error
        diverge; examples/configs/grpo_math_1B_megatron.yaml) and verl's Megatron-Bridge
        Qwen3-MoE ("none" for RL).
    moe_record_routing: the policy's scoring pass returns its routers' own choice, to log
        ``rollout_routing_mismatch`` against the engine's (one all-reduce of [B, S, L, K] int32
        over each of TP, CP and PP per scoring pass); None: when an engine that returns a
        routing generates (this backend's seeded sampler, or vLLM with
        ``rollout.routed_experts`` on a GPU). A routing to replay
        (``algorithm.router_replay=rollout``) is replayed either way.
    """

    model: str = DEFAULT_MODEL_NAME
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    sequence_packing: bool = False  # refused: trainer.pack_sequences sets it
    use_tp_pp_dp_mapping: bool = False
    rollout_engines_per_copy: int = 1
    make_vocab_size_divisible_by: int = 128
    entropy_chunk_size: int = 1024
    width_quantum: int = 128
    distributed_optimizer: Optional[bool] = None
    verify_checksums: bool = True
    transformer_impl: str = "transformer_engine"
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_dtype: Optional[str] = "fp32"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_record_routing: Optional[bool] = None


def check_options(cfg: MegatronBackendConfig) -> None:
    """ValueError naming the key of an option, dtype or sampler the backend cannot run."""
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
    if not is_count(cp, 1):
        raise ValueError(
            f"model.params.context_parallel_size={cp!r}: must be an integer >= 1 (a parallel size)"
        )
    e = cfg.rollout_engines_per_copy
    mp = int(cfg.tensor_model_parallel_size) * int(cfg.pipeline_model_parallel_size)
    if not is_count(e, 1) or mp % e:
        raise ValueError(
            f"model.params.rollout_engines_per_copy={e!r}: an integer >= 1 dividing TP x PP "
            f"= {mp} (each engine starts on the first rank of its block of the group)"
        )
    if cfg.sequence_packing:
        raise ValueError(
            "model.params.sequence_packing=true: packed (THD) sequences are set by "
            "trainer.pack_sequences (one source per setting)"
        )
    if not is_count(cfg.width_quantum, 0):
        raise ValueError(
            f"model.params.width_quantum={cfg.width_quantum!r}: an integer >= 0 (0 = exact widths)"
        )
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
        if not (is_number(v) and v >= 0):
            raise ValueError(f"model.params.{key}={v!r}: a number >= 0")
    if cfg.make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"model.params.make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by} "
            "must be >= 1"
        )
