"""A megatron-core model description (NeMo 2's model.yaml config, Megatron-Bridge's
run_config.yaml model section, Megatron-LM's args) -> the HF config the weight table
reads: the family from the fields, and the refusals naming the field."""

from __future__ import annotations

import pytest

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.mcore_config import _from_args
from nemo_d3s.formats.nemo2_context import hf_config_from_transformer_config
from nemo_d3s.formats.spec import ModelSpec

# Qwen3-32B as Megatron-Bridge's provider describes it
QWEN3 = {
    "num_layers": 64,
    "hidden_size": 5120,
    "ffn_hidden_size": 25600,
    "num_attention_heads": 64,
    "num_query_groups": 8,
    "kv_channels": 128,
    "layernorm_epsilon": 1e-6,
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": True,
    "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
    "position_embedding_type": "rope",
    "rotary_base": 1000000,
    "seq_length": 40960,
    "vocab_size": 151936,
    "share_embeddings_and_output_weights": False,
    "params_dtype": {"_target_": "torch.bfloat16", "_call_": False},
}


def test_the_family_comes_from_the_fields():
    spec = ModelSpec.from_hf_dict(hf_config_from_transformer_config(QWEN3, "rc"), "rc")
    assert spec.architecture == "Qwen3ForCausalLM" and spec.qk_norm and not spec.qkv_bias
    assert (spec.head_dim, spec.kv_heads, spec.torch_dtype) == (128, 8, "bfloat16")
    assert spec.num_params == 32_762_123_264
    qwen2 = hf_config_from_transformer_config(
        {**QWEN3, "qk_layernorm": False, "add_qkv_bias": True}, "rc"
    )
    llama = hf_config_from_transformer_config(
        {**QWEN3, "qk_layernorm": False, "rope_scaling": True, "rope_scaling_factor": 8.0}, "rc"
    )
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"]
    assert llama["architectures"] == ["LlamaForCausalLM"]
    assert ModelSpec.from_hf_dict(llama, "rc").rope_scaling_factor == 8.0


@pytest.mark.parametrize(
    "change,field",
    [
        (
            {"num_moe_experts": 8, "moe_router_topk": 2, "moe_router_score_function": "sigmoid"},
            "moe_router_score_function",
        ),
        ({"num_moe_experts": 8}, "moe_router_topk"),
        ({"normalization": "LayerNorm"}, "normalization"),
        ({"gated_linear_unit": False}, "gated_linear_unit"),
        ({"activation_func": {"_target_": "torch.nn.functional.gelu"}}, "activation_func"),
        ({"rotary_percent": 0.5}, "rotary_percent"),
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_what_the_table_cannot_map_names_the_field(change, field):
    with pytest.raises(ConfigError, match=f"run_config.yaml.*{field}"):
        hf_config_from_transformer_config({**QWEN3, **change}, "'run_config.yaml' model")


def test_a_qwen3_moe_provider_is_the_hf_model():
    """Megatron-Bridge's Qwen3-30B-A3B fields (its Qwen3MoEModelProvider: every layer MoE, 128
    experts of width 768, top-8 renormalised, q/k norms) describe the model of its HF
    config.json (the recipe's copy); Mixtral and Qwen2-MoE are told apart by their fields."""
    import json
    from importlib.resources import files

    hf = json.loads(files("nemo_d3s.recipes").joinpath("qwen3_30b_a3b/config.json").read_text())
    bridge = {
        **QWEN3,
        "num_layers": 48,
        "hidden_size": 2048,
        "ffn_hidden_size": 6144,
        "num_attention_heads": 32,
        "num_query_groups": 4,
        "layernorm_epsilon": 1e-6,
        "num_moe_experts": 128,
        "moe_ffn_hidden_size": 768,
        "moe_router_topk": 8,
        "moe_router_pre_softmax": False,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_grouped_gemm": True,
        "moe_layer_freq": 1,
    }
    mine = ModelSpec.from_hf_dict(hf_config_from_transformer_config(bridge, "rc"), "rc")
    theirs = ModelSpec.from_hf_dict(hf, "config.json")
    assert mine.to_dict() == theirs.to_dict()
    assert mine.num_params == theirs.num_params > 30e9
    mixtral = {**bridge, "qk_layernorm": False, "moe_ffn_hidden_size": 14336}
    assert hf_config_from_transformer_config(mixtral, "rc")["architectures"] == [
        "MixtralForCausalLM"
    ]
    with pytest.raises(ConfigError, match="moe_router_pre_softmax=True is not supported for Mix"):
        hf_config_from_transformer_config({**mixtral, "moe_router_pre_softmax": True}, "rc")
    qwen2 = {**mixtral, "add_qkv_bias": True, "moe_shared_expert_intermediate_size": 5632}
    with pytest.raises(ConfigError, match="moe_shared_expert_gate=None is not supported"):
        hf_config_from_transformer_config(qwen2, "rc")
    cfg = hf_config_from_transformer_config({**qwen2, "moe_shared_expert_gate": True}, "rc")
    assert (cfg["architectures"], cfg["shared_expert_intermediate_size"]) == (
        ["Qwen2MoeForCausalLM"],
        5632,
    )
    assert ModelSpec.from_hf_dict(cfg, "rc").moe_shared_ffn_hidden_size == 5632


def test_megatron_lm_args_translate_to_the_same_model():
    import torch

    args = {
        "num_layers": 64,
        "hidden_size": 5120,
        "ffn_hidden_size": 25600,
        "num_attention_heads": 64,
        "group_query_attention": True,
        "num_query_groups": 8,
        "kv_channels": 128,
        "norm_epsilon": 1e-6,
        "normalization": "RMSNorm",
        "swiglu": True,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "position_embedding_type": "rope",
        "rotary_base": 1000000,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "untie_embeddings_and_output_weights": True,
        "params_dtype": torch.bfloat16,
    }
    a = ModelSpec.from_hf_dict(hf_config_from_transformer_config(_from_args(args), "args"), "args")
    b = ModelSpec.from_hf_dict(hf_config_from_transformer_config(QWEN3, "rc"), "rc")
    assert a == b
    tied_mha = _from_args(
        {**args, "group_query_attention": False, "untie_embeddings_and_output_weights": False}
    )
    assert "num_query_groups" not in tied_mha and tied_mha["share_embeddings_and_output_weights"]


@pytest.mark.parametrize("source", ["run_config", "args"])
def test_megatron_cores_rope_scaling_flag_gives_a_config_transformers_loads(source, tmp_path):
    """megatron-core's ``rope_scaling`` (Megatron-LM ``--use-rope-scaling``, the run_config.yaml
    hf-to-megatron-lm writes) is llama3 scaling with fixed constants; transformers 5.x's
    LlamaConfig refuses a llama3 rope_scaling that does not state them (KeyError)."""
    import json

    import yaml
    from transformers import AutoConfig

    from nemo_d3s.formats.mcore_config import checkpoint_hf_config

    llama = {**QWEN3, "qk_layernorm": False, "rope_scaling": True, "rope_scaling_factor": 8.0}
    if source == "run_config":
        llama["params_dtype"] = "torch.bfloat16"
        (tmp_path / "run_config.yaml").write_text(yaml.safe_dump({"model": llama}))
        cfg = checkpoint_hf_config(tmp_path)[0]
    else:
        args = {"use_rope_scaling": True, "rope_scaling_factor": 8.0, "swiglu": True}
        cfg = hf_config_from_transformer_config(
            {**_from_args(args), **{k: v for k, v in llama.items() if k != "rope_scaling"}}, "a"
        )
    loaded = AutoConfig.for_model(**json.loads(json.dumps(cfg)))
    scaling = getattr(loaded, "rope_parameters", None) or loaded.rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert (scaling["low_freq_factor"], scaling["high_freq_factor"]) == (1.0, 4.0)
    assert scaling["original_max_position_embeddings"] == 8192
    assert ModelSpec.from_hf_dict(cfg, "rc").rope_scaling_factor == 8.0


@pytest.mark.parametrize(
    "nemo_field,arg,value",
    [
        ("window_size", "window_size", [4096, 0]),  # NeMo's MistralConfig7B
        ("layernorm_zero_centered_gamma", "apply_layernorm_1p", True),
        ("rotary_interleaved", "rotary_interleaved", True),
        ("seq_len_interpolation_factor", "rotary_seq_len_interpolation_factor", 4),
    ],
)
def test_fields_that_change_the_maths_are_refused_not_dropped(tmp_path, nemo_field, arg, value):
    """Sliding-window attention, zero-centred norm weights, interleaved or interpolated RoPE:
    a NeMo 2 model.yaml or Megatron-LM args setting one describe another model than the HF
    config they would map to; one line naming the file and the field. Unset / the full-window
    value [-1, -1] read as before."""
    import yaml

    from nemo_d3s.formats.nemo2_context import hf_config_from_nemo

    nemo = {**QWEN3, "_target_": "nemo.collections.llm.gpt.model.qwen3.Qwen3Config"}
    (tmp_path / "context").mkdir()
    model_yaml = tmp_path / "context" / "model.yaml"
    model_yaml.write_text(yaml.safe_dump({"config": {**nemo, nemo_field: value}}))
    with pytest.raises(ConfigError, match=rf"model.yaml'.*{nemo_field}=.* is not supported"):
        hf_config_from_nemo(tmp_path)
    args = {"swiglu": True, "num_layers": 2, arg: value}
    with pytest.raises(ConfigError, match=rf"^'common.pt' args: {nemo_field}="):
        hf_config_from_transformer_config({**QWEN3, **_from_args(args)}, "'common.pt' args")
    model_yaml.write_text(yaml.safe_dump({"config": {**nemo, "window_size": [-1, -1]}}))
    assert hf_config_from_nemo(tmp_path)["architectures"] == ["Qwen3ForCausalLM"]
