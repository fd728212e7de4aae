"""Typed configuration of the Megatron backend (``model.backend=megatron``; backend-specific
keys go in ``model.params`` under Megatron's own names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_d3s.core.checks import is_count
from nemo_d3s.backends.hf.gguf_convert import DEFAULT_MODEL_NAME
from nemo_d3s.backends.settings import PolicySettings

__all__ = [
    "CP_ENGINE_REFUSAL",
    "DTYPES",
    "MegatronBackendConfig",
    "TRANSFORMER_IMPLS",
    "check_options",
]

DTYPES = ("float32", "bfloat16")  # parameter dtypes besides "auto"
# Megatron-LM's --transformer-impl names (its "inference_optimized" is not offered).
TRANSFORMER_IMPLS = ("transformer_engine", "local")


# Context parallelism with an engine other than the policy's own: every CP rank's TP x PP
# group would start its own engine (backend.place_rollout_engine and the dry run refuse it).
CP_ENGINE_REFUSAL = (
    "a rollout engine other than the policy's own (rollout.engine=hf) is not shared across "
    "the CP ranks of a model copy yet; use rollout=hf, or context_parallel_size=1"
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
    context_parallel_size: CP; DP = world / (TP x PP x CP). Every sequence is cut into
        2 x CP chunks, rank r holding r and 2 CP - 1 - r (``core.context_parallel``);
        TE's CP attention on CUDA, ``local_attention`` (K/V all-gathered) on CPU; the
        rollouts come from the policy's own engine (:data:`CP_ENGINE_REFUSAL`).
    sequence_packing: refused, naming ``trainer.pack_sequences`` (packed rows).
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
    entropy_chunk_size: rows of the [b L, V/TP] logits the fused vocab-parallel
        entropy/log-prob kernel handles at once (bounds its workspace).
    width_quantum: micro-batch widths are multiples of it (0: exact), so a run feeds at
        most longest row / quantum shapes (TE builds a cuDNN graph per shape).
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
    sequence_packing: bool = False  # refused: trainer.pack_sequences sets it
    use_tp_pp_dp_mapping: bool = False
    make_vocab_size_divisible_by: int = 128
    entropy_chunk_size: int = 1024
    width_quantum: int = 128
    distributed_optimizer: Optional[bool] = None
    verify_checksums: bool = True
    transformer_impl: str = "transformer_engine"


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
    if not is_count(cp, 1):
        raise ValueError(
            f"model.params.context_parallel_size={cp!r}: must be an integer >= 1 (a parallel size)"
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
    if cfg.make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"model.params.make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by} "
            "must be >= 1"
        )
