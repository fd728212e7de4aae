"""Build this rank's ``GPTModel`` stage from a :class:`ModelSpec` (TE spec on CUDA, local on
CPU), load its rows from HF safetensors, and stream the model back out under HF names (one
parameter at a time gathered over TP and broadcast over PP).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.weights import (
    Layout,
    SafetensorsReader,
    assemble_hf,
    hf_shape,
    iter_stage_hf,
    local_names,
    local_parts,
    local_shape,
    read_local,
)
from nemo_d3s.backends.megatron.config import TRANSFORMER_IMPLS
from nemo_d3s.backends.megatron.moe import ExpertGroups, iter_expert_hf
from nemo_d3s.formats.moe import is_expert_param
from nemo_d3s.distributed.comm import global_rank_of, is_single
from nemo_d3s.distributed.groups import ParallelGroups

__all__ = [
    "TRANSFORMER_IMPLS",
    "transformer_engine_error",
    "use_transformer_engine",
    "transformer_config",
    "build_stage",
    "load_stage_from_hf",
    "iter_hf_weights",
    "virtual_layouts",
]


def transformer_engine_error() -> Optional[str]:
    """Why megatron-core cannot build its Transformer Engine layer spec here, or None.

    Any exception importing TE counts; then megatron-core's own ``HAVE_TE`` (0.16.1
    ``models/gpt/gpt_layer_specs.py:42-50`` clears it on an ImportError)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:
        return f"import transformer_engine.pytorch failed: {type(e).__name__}: {e}"
    try:
        from megatron.core.models.gpt import gpt_layer_specs
    except Exception as e:  # a TE import error other than ImportError escapes megatron's guard
        return f"import megatron.core.models.gpt.gpt_layer_specs failed: {type(e).__name__}: {e}"
    if not getattr(gpt_layer_specs, "HAVE_TE", False):
        try:
            from megatron.core.extensions.transformer_engine import TENorm  # noqa: F401
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider  # noqa: F401
        except Exception as e:
            return (
                "megatron-core's Transformer Engine extension failed to import: "
                f"{type(e).__name__}: {e}"
            )
        return "megatron-core's gpt_layer_specs reports HAVE_TE=False"
    return None


def use_transformer_engine(impl: str, device: torch.device) -> bool:
    """Whether this rank's stage takes the Transformer Engine layer spec; ConfigError when
    "transformer_engine" is asked on CUDA and TE does not import (no silent unfused fallback)."""
    if impl not in TRANSFORMER_IMPLS:
        raise ConfigError(
            f"model.params.transformer_impl={impl!r}: expected one of "
            f"{', '.join(TRANSFORMER_IMPLS)}"
        )
    if impl == "local" or device.type != "cuda":
        return False
    err = transformer_engine_error()
    if err is not None:
        raise ConfigError(
            "model.params.transformer_impl=transformer_engine (the default on CUDA) needs "
            f"Transformer Engine: {err}. Install the gpu extra (pip install "
            "'nemo_d3s[gpu]', or use slurm/Dockerfile), or set "
            "++model.params.transformer_impl=local for megatron-core's local spec (unfused "
            "attention: much slower and [b, heads, S, S] attention scores per layer)"
        )
    return True


def transformer_config(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype,
    device: torch.device,
    sequence_parallel: bool = False,
    recompute: bool = False,
    vpp: int = 1,
    cp: int = 1,
    moe: Optional[Dict[str, object]] = None,
):
    """``TransformerConfig`` of ``spec`` at TP x PP (x ``vpp``, x ``cp`` context parallel);
    dropout 0, so scoring and training compute the same function; ``moe``: its MoE fields
    (``moe.moe_config_kwargs``)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    cuda = device.type == "cuda"
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        # Qwen3's q/k norms: also what finalize_model_grads reads to sum their gradients
        # over TP (megatron-core 0.16.1 distributed/finalize_model_grads.py:353-355)
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Every weight is overwritten by the loader: skip Megatron's random init (minutes
        # for a 70B stage) and allocate on the CPU first only where there is no GPU.
        perform_initialization=False,
        use_cpu_initialization=not cuda,
        attention_softmax_in_fp32=True,
    )
    kwargs.update(moe or {})
    if recompute:
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return TransformerConfig(**kwargs)


def build_stage(
    spec: ModelSpec,
    config,
    layout: Layout,
    *,
    pre_process: bool,
    post_process: bool,
    device: torch.device,
    max_sequence_length: Optional[int] = None,
    vp_stage: Optional[int] = None,
):
    """This rank's GPTModel stage (or chunk ``vp_stage``), weights uninitialised; the TE spec
    when ``layout.te``, else the local spec with torch norms."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    pp_rank = (
        layout.pp_rank % config.pipeline_model_parallel_size
    )  # the real stage of a virtual one
    # qk_layernorm (Qwen3): both megatron-core 0.16.1 specs take it and put the spec's norm
    # in SelfAttentionSubmodules(q_layernorm, k_layernorm) (models/gpt/gpt_layer_specs.py,
    # TE spec: parameter :174, qk_norm = TESpecProvider.layer_norm(for_qk=True) = TENorm
    # :271, used :282-287; local spec: parameter :309, qk_norm = WrappedTorchNorm (torch
    # RMSNorm) :348, used :405-410); each is built over hidden_size=kv_channels
    # (transformer/attention.py:1280-1298) and applied per head before RoPE
    # (attention.py:1477-1481), as transformers' Qwen3Attention does (q_norm / k_norm).
    experts = spec.num_experts or None  # MoELayer in every layer (grouped GEMM with TE)
    if layout.te:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=spec.qk_norm
        )
    elif config.sequence_parallel:  # WrappedTorchNorm refuses SP: see sequence_parallel.py
        from nemo_d3s.backends.megatron.sequence_parallel import local_block_spec

        layer_spec = local_block_spec(config, pp_rank=pp_rank, vp_stage=vp_stage)
    else:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        # The block's final norm given explicitly: from a bare layer spec megatron-core 0.16.1
        # picks it by what imports (transformer_block.py:54-69: TENorm, else Apex's
        # FusedLayerNorm, which refuses RMSNorm, else torch), not by the spec asked for.
        layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        layer_spec = TransformerBlockSubmodules(
            layer_specs=[
                get_gpt_layer_local_spec(
                    num_experts=experts, normalization="RMSNorm", qk_layernorm=spec.qk_norm
                )
            ]
            * layers,
            layer_norm=WrappedTorchNorm,
        )
    if not layout.te:  # packed (THD) rows on the local spec: local_attention.py
        from nemo_d3s.backends.megatron.local_attention import with_packed_attention

        layer_spec = with_packed_attention(layer_spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=layout.padded_vocab,
        max_sequence_length=max_sequence_length or spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta)
        if float(spec.rope_theta).is_integer()
        else spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    model.to(device)
    # The local spec's torch norms are built without a dtype (megatron-core 0.16.1
    # transformer/torch_norm.py:51, 0.19.2 :69: norm_cls(normalized_shape, eps)), so they stay
    # fp32 in a bf16 model; the TE spec builds every parameter in params_dtype and Megatron-LM
    # casts the whole model (Float16Module: module.bfloat16(), 0.19.2 transformer/module.py:464).
    # Seen on an H200: the HF export refused the fp32 norm weights of a bf16 run.
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != config.params_dtype:
            p.data = p.data.to(config.params_dtype)
    _mark_tensor_parallel(model, spec, layout)
    names = [n for n, _ in model.named_parameters()]
    want = local_names(spec, layout)
    if sorted(names) != sorted(want):
        raise RuntimeError(
            f"megatron-core built parameters {sorted(set(names) ^ set(want))} that the "
            "weight table does not expect (a megatron-core version with other names?)"
        )
    return model


def _mark_tensor_parallel(model: torch.nn.Module, spec: ModelSpec, layout: Layout) -> None:
    """Set ``tensor_model_parallel`` / ``partition_dim`` from the weight table: Megatron sets
    them only in the random init we skip, and the grad norm and its optimizer read them. Every
    expert weight is parallel (its ETP split may be 1); norms and the router are duplicates."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, p in model.named_parameters():
        dim, parts = local_parts(name, spec, layout)
        full = hf_shape(parts[0].hf_name, spec)[dim] if parts[0].hf_name else None
        replicated = not is_expert_param(name) and (
            len(parts) == 1
            and parts[0].lo == 0
            and parts[0].rows == full
            and not (name.endswith("word_embeddings.weight") or name == "output_layer.weight")
        )
        if replicated:
            continue
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                delattr(p, attr)
        set_tensor_model_parallel_attributes(p, True, dim, 1)


@torch.no_grad()
def load_stage_from_hf(
    model: torch.nn.Module, spec: ModelSpec, layout: Layout, reader: SafetensorsReader
) -> None:
    """Copy this stage's rows of the HF tensors into ``model``; shapes checked before writing."""
    params = dict(model.named_parameters())
    for name, p in params.items():
        if tuple(p.shape) != local_shape(name, spec, layout):
            raise RuntimeError(
                f"{name}: GPTModel shape {tuple(p.shape)} != table "
                f"{local_shape(name, spec, layout)}"
            )
    for name, p in params.items():
        p.copy_(read_local(name, spec, layout, reader, p.dtype).to(p.device))


def _stage_src(groups: ParallelGroups, stage: int) -> int:
    """Global rank of pipeline stage ``stage`` in this rank's PP group."""
    return global_rank_of(groups.pp, stage)


def virtual_layouts(layout: Layout, vpp: int) -> List[Layout]:
    """Layouts of this rank's ``vpp`` chunks: chunk v of stage p is virtual stage v PP + p of
    a TP x (PP VPP) layout (megatron-core's ``get_transformer_layer_offset``)."""
    if vpp <= 1:
        return [layout]
    virtual = replace(layout, pp=layout.pp * vpp, pp_rank=0)
    return [virtual.at(layout.tp_rank, v * layout.pp + layout.pp_rank) for v in range(vpp)]


@torch.no_grad()
def iter_hf_weights(
    model,
    spec: ModelSpec,
    layout: Layout,
    groups: ParallelGroups,
    *,
    to_cpu: bool = True,
    vpp: int = 1,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the whole model on EVERY rank of the TP x PP group
    (collective over it). Per parameter: an all-gather over ``groups.tp`` on its stage, then
    one broadcast per HF tensor over ``groups.pp``. Memory: one parameter's shards at a time.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    params = [dict(c.named_parameters()) for c in chunks]
    first = next(iter(params[0].values()))
    device, dtype = first.device, first.dtype
    virtual = replace(layout, pp=layout.pp * vpp, pp_rank=0)
    experts = ExpertGroups.current() if spec.num_experts else ExpertGroups()
    for stage in range(virtual.pp):
        st = virtual.at(layout.tp_rank, stage)
        owner = stage % layout.pp  # the pipeline rank holding virtual stage ``stage``
        for local, produced in iter_stage_hf(local_names(spec, st), spec, st):
            if local == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            if is_expert_param(local):
                mine = params[stage // layout.pp][local] if owner == layout.pp_rank else None
                for h, x in iter_expert_hf(
                    local, mine, spec, st, experts, groups.pp, owner, device=device, dtype=dtype
                ):
                    yield h, (x.cpu() if to_cpu else x)
                continue
            full: Optional[Dict[str, torch.Tensor]] = None
            if owner == layout.pp_rank:
                t = params[stage // layout.pp][local].detach().contiguous()
                if layout.tp > 1:
                    shards = [torch.empty_like(t) for _ in range(layout.tp)]
                    dist.all_gather(shards, t, group=groups.tp)
                else:
                    shards = [t]
                full = assemble_hf(local, shards, spec, st)
            for h in produced:
                x = (
                    full[h]
                    if full is not None
                    else torch.empty(hf_shape(h, spec), dtype=dtype, device=device)
                )
                if not is_single(groups.pp):
                    dist.broadcast(x, src=_stage_src(groups, owner), group=groups.pp)
                yield h, (x.cpu() if to_cpu else x)
