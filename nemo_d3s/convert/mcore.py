"""``nemo-d3s-convert hf-to-megatron-lm``: any checkpoint this package reads -> a Megatron-LM /
Megatron-Bridge / NeMo-RL save folder that megatron-core's ``dist_checkpointing`` loads:
``latest_checkpointed_iteration.txt`` = "release" (nothing to resume), ``release/`` with the
TP1 global tensors under GPTModel's keys (a mixture of experts' under
``decoder.layers.mlp.experts.experts.*`` [layers, experts, ...], which the TE spec's grouped
GEMM and the local spec's SequentialMLP both load at any EP), ``common.pt`` (Megatron-LM's
``args``; inside the DCP files from megatron-core 0.19), ``run_config.yaml``
(Megatron-Bridge), ``tokenizer/``, and ``checksums.json``. The vocabulary is padded to
``make_vocab_size_divisible_by`` x ``tp``, which the loading run must compute too.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from nemo_d3s.convert.sources import (
    SideFiles,
    parse_dtype,
    folder_side_files,
    resolve_hf,
    with_side_files,
    open_checkpoint,
)
from nemo_d3s.core.checks import is_count
from nemo_d3s.errors import ConfigError
from nemo_d3s.files import write_checksums
from nemo_d3s.formats.detect import HF, TRACKER, detect_format
from nemo_d3s.formats.mcore_config import RUN_CONFIG
from nemo_d3s.formats.moe import moe_transformer_fields
from nemo_d3s.formats.spec import ModelSpec, check_layout, padded_vocab_size
from nemo_d3s.formats.weights import SafetensorsReader, hf_names, hf_shape

__all__ = ["hf_to_megatron_lm", "megatron_lm_args", "bridge_model_section"]

RELEASE = "release"


def _fields(spec: ModelSpec, padded: int, divisor: int, tp: int, dtype: torch.dtype):
    """The model as megatron-core's TransformerConfig / GPTModel fields."""
    return {
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_query_groups": spec.kv_heads,
        "kv_channels": spec.head_dim,
        "layernorm_epsilon": spec.norm_eps,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "add_qkv_bias": spec.qkv_bias,
        "qk_layernorm": spec.qk_norm,
        "position_embedding_type": "rope",
        "rotary_base": int(spec.rope_theta)
        if float(spec.rope_theta).is_integer()
        else spec.rope_theta,
        "rotary_percent": 1.0,
        "rope_scaling": spec.rope_scaling_factor is not None,
        "rope_scaling_factor": spec.rope_scaling_factor or 8.0,
        "seq_length": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "make_vocab_size_divisible_by": divisor,
        "share_embeddings_and_output_weights": spec.tie_word_embeddings,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "_padded": padded,
        **_moe_fields(spec),
    }


def _moe_fields(spec: ModelSpec) -> Dict[str, Any]:
    """The MoE fields of TransformerConfig (the backend's own, ``backends/megatron/moe.py``):
    every layer MoE, softmax scores, top-k renormalised unless ``moe_router_pre_softmax``, the
    TE spec's grouped GEMM (its checkpoint keys are SequentialMLP's, so either spec loads)."""
    f = moe_transformer_fields(spec)
    if not f:
        return {}
    if not spec.moe_shared_ffn_hidden_size:  # no shared expert: its fields stay unwritten
        del f["moe_shared_expert_intermediate_size"], f["moe_shared_expert_gate"]
    return {**f, "moe_grouped_gemm": True}


def megatron_lm_args(f: Dict[str, Any], dtype: torch.dtype) -> argparse.Namespace:
    """Megatron-LM's ``args`` of the model (what its ``--use-checkpoint-args`` and the
    checkpoint checks read; the argument names of ``megatron/training/arguments.py``)."""
    return argparse.Namespace(
        num_layers=f["num_layers"],
        hidden_size=f["hidden_size"],
        ffn_hidden_size=f["ffn_hidden_size"],
        num_attention_heads=f["num_attention_heads"],
        group_query_attention=f["num_query_groups"] != f["num_attention_heads"],
        num_query_groups=f["num_query_groups"],
        kv_channels=f["kv_channels"],
        norm_epsilon=f["layernorm_epsilon"],
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=f["add_qkv_bias"],
        qk_layernorm=f["qk_layernorm"],
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        add_position_embedding=False,
        rotary_base=f["rotary_base"],
        rotary_percent=1.0,
        use_rope_scaling=f["rope_scaling"],
        rope_scaling_factor=f["rope_scaling_factor"],
        max_position_embeddings=f["seq_length"],
        seq_length=f["seq_length"],
        vocab_size=f["vocab_size"],
        padded_vocab_size=f["_padded"],
        make_vocab_size_divisible_by=f["make_vocab_size_divisible_by"],
        untie_embeddings_and_output_weights=not f["share_embeddings_and_output_weights"],
        tensor_model_parallel_size=f["tensor_model_parallel_size"],
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        params_dtype=dtype,
        bf16=f["bf16"],
        fp16=f["fp16"],
        tokenizer_type="HuggingFaceTokenizer",
        ckpt_format="torch_dist",
        no_save_optim=True,
        no_save_rng=True,
        iteration=0,
        # Megatron-LM names TransformerConfig's num_moe_experts --num-experts; the other MoE
        # arguments carry the field's own name (arguments.py; core_transformer_config_from_args)
        **{("num_experts" if k == "num_moe_experts" else k): v for k, v in _moe_args(f).items()},
    )


def _moe_args(f: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in f.items() if k.startswith(("moe_", "num_moe_"))}


def bridge_model_section(f: Dict[str, Any], dtype: torch.dtype) -> Dict[str, Any]:
    """Megatron-Bridge's ``run_config.yaml`` ``model:`` section (a GPTModelProvider; functions
    and dtypes as its YAML representers write them)."""
    model = {"_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider"}
    model.update({k: v for k, v in f.items() if not k.startswith("_")})
    model["activation_func"] = {"_target_": "torch.nn.functional.silu", "_call_": False}
    model["params_dtype"] = {"_target_": str(dtype), "_call_": False}
    return model


def hf_to_megatron_lm(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tp: int = 1,
    dtype: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
    hf_config: Optional[str | os.PathLike] = None,
    overwrite: bool = False,
    progress: bool = True,
    verify_checksums: bool = True,
) -> Path:
    """Write ``src`` (any checkpoint ``open_checkpoint`` reads) as the save folder ``out``;
    ``dtype`` None keeps the stored dtype; ``tp`` and ``make_vocab_size_divisible_by`` fix the
    vocabulary padding the loading run must compute. Returns ``out``.
    """
    import yaml

    from nemo_d3s.backends.megatron.nemo2_writer import write_dist_checkpoint
    from nemo_d3s.convert.core import progress_bar, staged_output

    for name, v in (("tp", tp), ("make_vocab_size_divisible_by", make_vocab_size_divisible_by)):
        if not is_count(v, 1):
            raise ConfigError(f"--{name.replace('_', '-')}={v!r} must be an integer >= 1")
    p = Path(src).expanduser()
    if detect_format(p).kind in (HF, None):  # a model folder (or the embedded model's name)
        folder = resolve_hf(src)
        spec = ModelSpec.from_folder(folder)
        reader = SafetensorsReader(folder, spec)
        reader.check()
        side: SideFiles = folder_side_files(folder, role="--hf")
        stored = {reader.rows(n, 0, 0, 1).dtype for n in hf_names(spec)}
        sources = [folder]

        def tensors():
            for n in hf_names(spec):
                yield n, reader.rows(n, 0, 0, hf_shape(n, spec)[0])
    else:
        ck = with_side_files(
            open_checkpoint(p, hf_config, verify_checksums=verify_checksums), role="--hf-config"
        )
        spec, side, sources = ck.spec, ck.side, [ck.folder]
        stored = {ck.dtype} if ck.dtype is not None else {torch.float32, torch.bfloat16}
        tensors = ck.iter_hf
    try:  # the heads must split evenly over the loading run's TP ranks
        check_layout(spec, tp=tp, pp=1, world=tp)
    except ConfigError as e:
        raise ConfigError(f"--tp {tp}: {e}") from None
    want = parse_dtype(dtype) or (stored.pop() if len(stored) == 1 else None)
    if want is None:
        raise ConfigError(f"{str(p)!r} stores parameters in several dtypes; pass --dtype")
    padded = padded_vocab_size(spec.vocab_size, tp, make_vocab_size_divisible_by)
    f = _fields(spec, padded, make_vocab_size_divisible_by, tp, want)
    total = sum(n * want.itemsize for n in (_numel(x, spec) for x in hf_names(spec)))
    with staged_output(out, overwrite=overwrite, sources=sources) as tmp:
        it = tmp / RELEASE
        with progress_bar(total, "hf-to-megatron-lm", progress) as bar:

            def counted():
                for name, t in tensors():
                    bar.update(t.numel() * want.itemsize)
                    yield name, t.to(want)

            write_dist_checkpoint(
                counted(),
                spec,
                it,
                padded_vocab=padded,
                prefix="",
                model_key="model",
                common={
                    "args": megatron_lm_args(f, want),
                    "iteration": 0,
                    "checkpoint_version": 3.0,
                },
            )
        run_config = {
            "model": bridge_model_section(f, want),
            "checkpoint": {
                "save_optim": False,
                "save_rng": False,
                "fully_parallel_save": False,
                "ckpt_format": "torch_dist",
            },
        }
        (it / RUN_CONFIG).write_text(yaml.safe_dump(run_config, sort_keys=False))
        tok = it / "tokenizer"
        tok.mkdir()
        side.write(tok, want)  # the tokenizer files, generation_config.json (and config.json)
        (tmp / TRACKER).write_text(RELEASE + "\n")
        write_checksums(tmp)
    return Path(out)


def _numel(name: str, spec: ModelSpec) -> int:
    n = 1
    for d in hf_shape(name, spec):
        n *= d
    return n
