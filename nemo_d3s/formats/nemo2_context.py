"""A NeMo 2 ``context/model.yaml`` (fiddle YAML, read with ``yaml.safe_load``) as the HF
``config.json`` dict it describes (Llama, Llama 3.1 RoPE, Mistral, Qwen2, Qwen3; from a
Megatron-LM / Megatron-Bridge description also Qwen3-MoE, Mixtral and Qwen2-MoE); anything else
is a ConfigError naming file and field. Does not import ``spec`` (no import cycle).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

from nemo_d3s.errors import ConfigError

__all__ = [
    "LLAMA3_FIXED",
    "hf_config_from_nemo",
    "hf_config_from_transformer_config",
    "nemo_make_vocab_size_divisible_by",
]


# Megatron implements Llama 3.x RoPE scaling with these fixed constants (megatron-core
# 0.16.1 models/common/embeddings/rotary_pos_embedding.py:92-98, RotaryEmbedding._apply_scaling
# defaults); only the factor is a GPTModel argument. transformers 5.x's LlamaConfig refuses a
# llama3 rope_scaling without low_freq_factor / high_freq_factor, so an HF config written from
# megatron-core's flag states them all.
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _yaml(path: Path) -> Dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConfigError(f"{str(path)!r} is missing: not a NeMo 2 checkpoint context")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise ConfigError(f"{str(path)!r} holds no model config (a 'config:' mapping)")
    return data


def _target(node: Any) -> str:
    return str(node.get("_target_", "")) if isinstance(node, dict) else str(node)


_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    # mixtures of experts (Megatron-LM / Megatron-Bridge: told apart by their fields)
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
_DENSE = ("llama", "mistral", "qwen2", "qwen3")


# Fields that change the maths of a layer the weight table maps as plain Llama attention /
# RMSNorm / RoPE; their value the HF config cannot state is refused, never dropped. megatron-core
# 0.16.1 transformer_config.py:155 (layernorm_zero_centered_gamma: weight + 1), :192
# (rotary_interleaved), :196 (window_size, sliding-window attention; NeMo's MistralConfig7B
# sets [4096, 0]); seq_len_interpolation_factor is GPTModel's linear RoPE position scaling.
_MATHS_FIELDS = (
    ("window_size", lambda v: v in (None, [-1, -1], (-1, -1)), "full causal attention only"),
    ("layernorm_zero_centered_gamma", lambda v: not v, "RMSNorm weights as stored"),
    ("rotary_interleaved", lambda v: not v, "RoPE on the two halves of each head"),
    ("seq_len_interpolation_factor", lambda v: v in (None, 1, 1.0), "no RoPE interpolation"),
)


def _moe_config(c: Dict[str, Any], where: str, model_type: str, need) -> Dict[str, Any]:
    """The HF config's MoE keys of a TransformerConfig-shaped mapping whose MoE layers the weight
    table maps (``formats/moe.py``): every layer MoE, softmax router scores, no expert bias,
    grouping or top-k scaling; Mixtral renormalises its top-k, a Qwen2-MoE's shared expert has
    its sigmoid gate. Anything else is a ConfigError naming the field."""
    for key, ok in (
        ("moe_router_score_function", lambda v: v in (None, "softmax")),
        ("moe_layer_freq", lambda v: v in (None, 1, [1] * int(c.get("num_layers") or 0))),
        ("moe_router_enable_expert_bias", lambda v: not v),
        ("moe_router_num_groups", lambda v: v in (None, 0, 1)),
        ("moe_router_topk_scaling_factor", lambda v: v in (None, 1, 1.0)),
        ("moe_router_pre_softmax", lambda v: not (v and model_type == "mixtral")),
        ("moe_shared_expert_gate", lambda v: v or model_type != "qwen2_moe"),
        ("moe_shared_expert_intermediate_size", lambda v: not v or model_type == "qwen2_moe"),
        ("multi_latent_attention", lambda v: not v),
    ):
        if not ok(c.get(key)):
            raise ConfigError(
                f"{where}: {key}={c.get(key)!r} is not supported for {_ARCHS[model_type][0]} "
                "(the weight table maps softmax-routed experts in every layer: Qwen3-MoE, "
                "Mixtral, Qwen2-MoE with its gated shared expert)"
            )
    experts, topk = need("num_moe_experts"), need("moe_router_topk")
    width = c.get("moe_ffn_hidden_size") or need("ffn_hidden_size")
    renormalise = not c.get("moe_router_pre_softmax", False)
    if model_type == "mixtral":
        return {
            "num_local_experts": experts,
            "num_experts_per_tok": topk,
            "intermediate_size": width,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    out = {
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": width,
        "norm_topk_prob": renormalise,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
    }
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = need("moe_shared_expert_intermediate_size")
    return out


def hf_config_from_nemo(folder: str | os.PathLike) -> Dict[str, Any]:
    """The HF ``config.json`` dict of ``folder/context/model.yaml``; ConfigError naming the file
    and field when the mapping does not cover it.
    """
    path = Path(folder) / "context" / "model.yaml"
    c = _yaml(path)["config"]
    where = f"{str(path)!r}"
    target = _target(c)
    module, _, cls = target.rpartition(".")
    kind = module.rsplit(".", 1)[-1]
    if kind not in _DENSE or "Llama4" in cls:
        raise ConfigError(
            f"{where}: config._target_={target!r} is not supported; NeMo 2 Llama, Mistral, "
            "Qwen2 and Qwen3 configs are"
        )
    if c.get("num_moe_experts"):
        raise ConfigError(
            f"{where}: num_moe_experts={c['num_moe_experts']!r}: NeMo 2 mixture-of-experts "
            "checkpoints are not read (Megatron-LM / Megatron-Bridge ones are)"
        )
    cfg = hf_config_from_transformer_config(c, where, kind)
    gen = Path(folder) / "context" / "artifacts" / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{str(gen)!r} is not valid JSON: {e}") from None
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(g, dict) and g.get(key) is not None:
                cfg[key] = g[key]
    return cfg


def hf_config_from_transformer_config(
    c: Dict[str, Any], where: str, kind: Optional[str] = None
) -> Dict[str, Any]:
    """A megatron-core ``TransformerConfig``-shaped mapping (NeMo 2, Megatron-Bridge, Megatron-LM
    args) -> the HF ``config.json`` dict. ``kind`` None infers the family (``qk_layernorm``:
    Qwen3, ``add_qkv_bias``: Qwen2, else Llama; with ``num_moe_experts``: Qwen3-MoE with q/k
    norms, Qwen2-MoE with a shared expert, else Mixtral); ``where`` names the source in errors.
    """
    moe = bool(c.get("num_moe_experts"))
    if kind is None and moe:
        kind = (
            "qwen3_moe"
            if c.get("qk_layernorm")
            else "qwen2_moe"
            if c.get("moe_shared_expert_intermediate_size")
            else "mixtral"
        )
    elif kind is None:
        kind = "qwen3" if c.get("qk_layernorm") else "qwen2" if c.get("add_qkv_bias") else "llama"
    checks = {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "position_embedding_type": "rope",
        "add_bias_linear": False,
        "qk_layernorm": kind in ("qwen3", "qwen3_moe"),
    }
    for key, want in checks.items():
        if key in c and c[key] != want:
            raise ConfigError(
                f"{where}: {key}={c[key]!r} is not supported for {_ARCHS[kind][0]} (the "
                f"weight table needs {want!r})"
            )
    if c.get("qk_l2_norm") or c.get("multi_latent_attention") or c.get("attention_output_gate"):
        raise ConfigError(
            f"{where}: qk_l2_norm / multi_latent_attention / attention_output_gate are not "
            "supported"
        )
    for key, ok, supported in _MATHS_FIELDS:
        if not ok(c.get(key)):
            raise ConfigError(f"{where}: {key}={c[key]!r} is not supported ({supported})")
    act = _target(c.get("activation_func", {"_target_": "torch.nn.functional.silu"}))
    if act != "torch.nn.functional.silu":
        raise ConfigError(
            f"{where}: activation_func={act!r} is not supported (SwiGLU with silu only)"
        )
    if float(c.get("rotary_percent", 1.0)) != 1.0:
        raise ConfigError(f"{where}: rotary_percent={c['rotary_percent']!r}: only 1.0 is supported")

    def need(key: str) -> Any:
        if c.get(key) is None:
            raise ConfigError(f"{where}: {key} is not set")
        return c[key]

    heads, hidden = need("num_attention_heads"), need("hidden_size")
    dtype = _target(c.get("params_dtype", "torch.float32")).replace("torch.", "")
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "bfloat16" if c.get("bf16") else "float32"
    arch, model_type = _ARCHS[kind]
    cfg: Dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": need("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": need("ffn_hidden_size"),
        "num_hidden_layers": need("num_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": c.get("num_query_groups") or heads,
        "head_dim": c.get("kv_channels") or hidden // heads,
        "rms_norm_eps": float(need("layernorm_epsilon")),
        "rope_theta": float(c.get("rotary_base", 10000.0)),
        "max_position_embeddings": need("seq_length"),
        "tie_word_embeddings": bool(c.get("share_embeddings_and_output_weights", False)),
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "initializer_range": float(c.get("init_method_std", 0.02)),
    }
    if moe:
        cfg.update(_moe_config(c, where, model_type, need))
    if model_type == "qwen2":
        if c.get("add_qkv_bias") is False:
            raise ConfigError(
                f"{where}: add_qkv_bias=false: a Qwen2 without q/k/v bias is not supported"
            )
        cfg["use_sliding_window"] = False
    elif model_type in ("qwen3", "qwen3_moe"):
        if c.get("add_qkv_bias"):
            raise ConfigError(f"{where}: add_qkv_bias=true: a Qwen3 has no q/k/v bias")
        cfg.update(use_sliding_window=False, attention_bias=False)
    elif model_type == "qwen2_moe":
        cfg.update(use_sliding_window=False, qkv_bias=bool(c.get("add_qkv_bias", True)))
    elif model_type == "mixtral":
        if c.get("add_qkv_bias"):
            raise ConfigError(f"{where}: add_qkv_bias=true: a Mixtral has no q/k/v bias")
        cfg["sliding_window"] = None
    else:
        cfg["attention_bias"] = bool(c.get("add_qkv_bias", False))
        cfg["mlp_bias"] = False
    if c.get("scale_factor") is not None:  # Llama31Config and its children: llama3 RoPE scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(c.get("scale_factor", 8.0)),
            "low_freq_factor": float(c.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(c.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(c.get("old_context_len", 8192)),
        }
    elif c.get("rope_scaling"):  # megatron-core's own flag: llama3 scaling, fixed constants
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(c.get("rope_scaling_factor", 8.0)),
            **LLAMA3_FIXED,
        }
    return cfg


def nemo_make_vocab_size_divisible_by(folder: str | os.PathLike) -> int:
    """The vocabulary padding multiple of a NeMo 2 folder's model.yaml (NeMo's 128 by default)."""
    v = _yaml(Path(folder) / "context" / "model.yaml")["config"].get(
        "make_vocab_size_divisible_by", 128
    )
    return int(v) if isinstance(v, int) and v > 0 else 128
