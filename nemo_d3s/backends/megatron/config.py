"""Typed configuration of the Megatron backend (``model.backend=megatron``; backend-specific
keys go in ``model.params`` under Megatron's own names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_d3s.core.checks import is_count
from nemo_d3s.backends.hf.gguf_convert import DEFAULT_MODEL_NAME
from nemo_d3s.backends.settings import PolicySettings

__all__ = ["DTYPES", "MegatronBackendConfig", "TRANSFORMER_IMPLS", "check_options"]

DTYPES = ("float32", "bfloat16")  # parameter dtypes besides "auto"
# Megatron-LM's --transformer-impl names (its "inference_optimized" is not offered).
TRANSFORMER_IMPLS = ("transformer_engine", "local")


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

    model: an HF folder, a converted Megatron folder, a NeMo 2 or Megatron-LM / Bridge save,
        or the embedded "smollm2-135m-instruct". dtype: "auto" = fp32 on CPU, bf16 on CUDA
        (bf16 parameters always train on fp32 main weights and moments).
    TP must divide the heads, KV heads and FFN width; PP the layers; VPP > 1 (PP > 1) runs
        interleaved 1F1B. context_parallel_size / sequence_packing: only 1 / false run
        (:data:`CONTEXT_PARALLEL_REFUSAL`).
    use_tp_pp_dp_mapping: ranks laid out tp-cp-ep-pp-dp, so each model copy (and its
        engine) sits on consecutive ranks; the math is unchanged.
    distributed_optimizer: Megatron's DDP + distributed optimizer (None: CUDA only) or
        plain AdamW over this rank's shards; checkpoints resume across both and any layout.
    transformer_impl: "transformer_engine" (an import failure is an error) or "local"; the
        CPU always takes the local spec. entropy_chunk_size: rows of the [b L, V/TP]
        logits the vocab-parallel kernel takes at once.
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
    if cfg.make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"model.params.make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by} "
            "must be >= 1"
        )
