"""A NeMo 2 checkpoint's ``context/model.yaml`` (NeMo's fiddle YAML of the model config) as
the Hugging Face ``config.json`` dict it corresponds to.

Read with ``yaml.safe_load`` (no code runs); Llama / Llama 3.1 RoPE scaling, Mistral and
Qwen2 configs are mapped, anything else is a ConfigError naming the file and field. The
dict is checked against the weight table by ``spec.ModelSpec.from_hf_dict`` (which
``ModelSpec.from_folder`` does for a NeMo 2 folder); this module does not import the spec, so
the spec can read a NeMo 2 folder without an import cycle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

from nemo_d3s.errors import ConfigError

__all__ = ["hf_config_from_nemo", "nemo_make_vocab_size_divisible_by"]


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


def hf_config_from_nemo(folder: str | os.PathLike) -> Dict[str, Any]:
    """The HF ``config.json`` dict of the model in ``folder/context/model.yaml``; a
    ConfigError naming the file and field for a model NeMo describes in a way the mapping
    does not cover (the table's own checks: ``ModelSpec.from_hf_dict``)."""
    path = Path(folder) / "context" / "model.yaml"
    c = _yaml(path)["config"]
    where = f"{str(path)!r}"
    target = _target(c)
    module, _, cls = target.rpartition(".")
    kinds = {
        "llama": ("LlamaForCausalLM", "llama"),
        "mistral": ("MistralForCausalLM", "mistral"),
        "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    }
    kind = kinds.get(module.rsplit(".", 1)[-1])
    if kind is None or "Llama4" in cls or c.get("num_moe_experts"):
        raise ConfigError(
            f"{where}: config._target_={target!r} is not supported; NeMo 2 Llama, Mistral "
            "and Qwen2 configs are"
        )
    checks = {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "position_embedding_type": "rope",
        "add_bias_linear": False,
        "qk_layernorm": False,
    }
    for key, want in checks.items():
        if key in c and c[key] != want:
            raise ConfigError(
                f"{where}: config.{key}={c[key]!r} is not supported (the weight table "
                f"needs {want!r})"
            )
    act = _target(c.get("activation_func", {"_target_": "torch.nn.functional.silu"}))
    if act != "torch.nn.functional.silu":
        raise ConfigError(
            f"{where}: config.activation_func={act!r} is not supported (SwiGLU with silu only)"
        )

    def need(key: str) -> Any:
        if c.get(key) is None:
            raise ConfigError(f"{where}: config.{key} is not set")
        return c[key]

    heads, hidden = need("num_attention_heads"), need("hidden_size")
    dtype = _target(c.get("params_dtype", "torch.float32")).replace("torch.", "")
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "bfloat16" if c.get("bf16") else "float32"
    arch, model_type = kind
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
    if model_type == "qwen2":
        if c.get("add_qkv_bias") is False:
            raise ConfigError(
                f"{where}: config.add_qkv_bias=false: a Qwen2 without q/k/v bias is not supported"
            )
        cfg["use_sliding_window"] = False
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


def nemo_make_vocab_size_divisible_by(folder: str | os.PathLike) -> int:
    v = _yaml(Path(folder) / "context" / "model.yaml")["config"].get(
        "make_vocab_size_divisible_by", 128
    )
    return int(v) if isinstance(v, int) and v > 0 else 128
