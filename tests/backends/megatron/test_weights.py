"""The HF <-> Megatron weight table (``formats.weights``) and the config mapping
(``formats.spec``): hand-worked layouts, a round trip at every TP x PP
position, and the start-up errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_d3s.formats.spec import ModelSpec, check_layout, padded_vocab_size
from nemo_d3s.formats.weights import (
    Layout,
    assemble_hf,
    hf_names,
    hf_shape,
    local_names,
    local_shape,
    read_local,
)
from nemo_d3s.config import ConfigError


def _spec(**kw) -> ModelSpec:
    base = dict(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=10,
        hidden_size=4,
        ffn_hidden_size=6,
        num_layers=4,
        num_heads=4,
        kv_heads=2,
        head_dim=1,
        norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling_factor=None,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        qkv_bias=False,
    )
    base.update(kw)
    return ModelSpec(**base)


class DictReader:
    """A reader over in-memory full HF tensors (the test's slow, obvious source)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def rows(self, name, dim, lo, hi):
        return self.tensors[name].narrow(dim, lo, hi - lo)


def _full(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(hf_shape(n, spec), generator=g) for n in hf_names(spec)}


# ---------------------------------------------------------------------------- hand-worked
def test_qkv_rows_follow_megatrons_query_group_order():
    """4 query heads, 2 kv heads, head_dim 1, hidden 1: q = [q0 q1 q2 q3], k = [k0 k1],
    v = [v0 v1]. Megatron's fused QKV is per query group [q heads of g, k_g, v_g]."""
    spec = _spec(hidden_size=1, head_dim=1)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[10.0], [11.0], [12.0], [13.0]]),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[20.0], [21.0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[30.0], [31.0]]),
    }
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    tp1 = read_local(name, spec, Layout(1, 1, 0, 0, 128), DictReader(full), torch.float32)
    assert tp1.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    r1 = read_local(name, spec, Layout(2, 1, 1, 0, 128), DictReader(full), torch.float32)
    assert r1.flatten().tolist() == [12, 13, 21, 31]


def test_gate_up_and_vocab_padding_by_hand():
    spec = _spec(hidden_size=1, ffn_hidden_size=4, vocab_size=3)
    full = {
        "model.layers.0.mlp.gate_proj.weight": torch.tensor([[1.0], [2.0], [3.0], [4.0]]),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[5.0], [6.0], [7.0], [8.0]]),
        "model.embed_tokens.weight": torch.tensor([[1.0], [2.0], [3.0]]),
    }
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert read_local(
        fc1, spec, Layout(2, 1, 0, 0, 4), DictReader(full), torch.float32
    ).flatten().tolist() == [1, 2, 5, 6]
    assert read_local(
        fc1, spec, Layout(2, 1, 1, 0, 4), DictReader(full), torch.float32
    ).flatten().tolist() == [3, 4, 7, 8]
    emb = "embedding.word_embeddings.weight"
    # vocabulary 3 padded to 4 over TP 2: rank 0 rows [0, 1], rank 1 rows [2, pad]
    assert read_local(
        emb, spec, Layout(2, 1, 1, 0, 4), DictReader(full), torch.float32
    ).flatten().tolist() == [3, 0]
    assert padded_vocab_size(49152, 3) == 49152 and padded_vocab_size(300, 2) == 512


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qkv_bias,qk_norm", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
def test_split_then_assemble_is_the_identity(tp, pp, tied, qkv_bias, qk_norm):
    spec = _spec(
        tie_word_embeddings=tied,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        hidden_size=8,
        head_dim=2,
        ffn_hidden_size=6,
    )
    full = _full(spec)
    pv = padded_vocab_size(spec.vocab_size, tp, 4)
    back = {}
    for stage in range(pp):
        names = local_names(spec, Layout(tp, pp, 0, stage, pv))
        for name in names:
            shards = []
            for r in range(tp):
                lay = Layout(tp, pp, r, stage, pv)
                t = read_local(name, spec, lay, DictReader(full), torch.float32)
                assert tuple(t.shape) == local_shape(name, spec, lay)
                shards.append(t)
            if name == "output_layer.weight" and tied:
                # the last stage's copy of the tied embedding equals the embedding shard
                continue
            back.update(assemble_hf(name, shards, spec, Layout(tp, pp, 0, stage, pv)))
    assert sorted(back) == sorted(full)
    for k in full:
        assert torch.equal(back[k], full[k]), k


def test_qk_norms_are_one_head_wide_and_replicated_over_tp():
    """Qwen3: q_norm / k_norm [head_dim] map to q_layernorm / k_layernorm whole on every TP
    rank, after linear_qkv in the layer's parameter order."""
    spec = _spec(qk_norm=True, architecture="Qwen3ForCausalLM", head_dim=3, hidden_size=4)
    full = {
        "model.layers.1.self_attn.q_norm.weight": torch.tensor([1.0, 2.0, 3.0]),
        "model.layers.1.self_attn.k_norm.weight": torch.tensor([4.0, 5.0, 6.0]),
    }
    for r in (0, 1):  # TP2 x PP2: global layer 1 is stage 0's layer 1
        lay = Layout(2, 2, r, 0, 128)
        q = read_local(
            "decoder.layers.1.self_attention.q_layernorm.weight",
            spec,
            lay,
            DictReader(full),
            torch.float32,
        )
        k = read_local(
            "decoder.layers.1.self_attention.k_layernorm.weight",
            spec,
            lay,
            DictReader(full),
            torch.float32,
        )
        assert q.tolist() == [1, 2, 3] and k.tolist() == [4, 5, 6]
    names = local_names(spec, Layout(1, 1, 0, 0, 128))
    i = names.index("decoder.layers.0.self_attention.linear_qkv.weight")
    assert names[i + 1 : i + 3] == [
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.self_attention.k_layernorm.weight",
    ]
    assert "model.layers.3.self_attn.k_norm.weight" in hf_names(spec)


def test_qwen3_32b_param_count_by_hand():
    """Qwen3-32B's published config: per layer q 5120x8192, k and v 5120x1024, o 8192x5120,
    q/k norms 2 x 128, MLP 3 x 5120 x 25600, two norms 2 x 5120; 64 layers, untied
    151936-row embedding and output layer, the final norm: 32,762,123,264 ("32.8B")."""
    spec = _spec(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=5120,
        ffn_hidden_size=25600,
        num_layers=64,
        num_heads=64,
        kv_heads=8,
        head_dim=128,
        qk_norm=True,
    )
    layer = 5120 * 8192 + 2 * 5120 * 1024 + 8192 * 5120 + 2 * 128 + 3 * 5120 * 25600 + 2 * 5120
    assert layer == 487_598_336
    assert spec.num_params == 64 * layer + 2 * 151936 * 5120 + 5120 == 32_762_123_264


def test_param_count_matches_a_hand_count():
    # SmolLM2-135M: 134,515,008 parameters (tied embeddings), the published size
    spec = _spec(
        vocab_size=49152,
        hidden_size=576,
        ffn_hidden_size=1536,
        num_layers=30,
        num_heads=9,
        kv_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    )
    assert spec.num_params == 134_515_008


# ---------------------------------------------------------------------------- config mapping
def _hf_cfg(**kw):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "rope_theta": 500000.0,
    }
    cfg.update(kw)
    return cfg


def test_transformers_5_and_4_rope_fields_both_map():
    a = ModelSpec.from_hf_dict(
        _hf_cfg(rope_theta=None, rope_parameters={"rope_theta": 1e5, "rope_type": "default"})
    )
    b = ModelSpec.from_hf_dict(_hf_cfg(rope_theta=1e5))
    assert a.rope_theta == b.rope_theta == 1e5 and a.rope_scaling_factor is None
    llama31 = ModelSpec.from_hf_dict(
        _hf_cfg(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    assert llama31.rope_scaling_factor == 8.0
    qwen = ModelSpec.from_hf_dict(
        _hf_cfg(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=4096)
    )
    assert qwen.qkv_bias and qwen.kv_heads == 2 and qwen.head_dim == 8
    qwen3 = ModelSpec.from_hf_dict(
        _hf_cfg(architectures=["Qwen3ForCausalLM"], head_dim=16, sliding_window=None)
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16
    assert not qwen.qk_norm


@pytest.mark.parametrize(
    "change,field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 32.0,
                    "original_max_position_embeddings": 4096,
                }
            },
            "original_max_position_embeddings",
        ),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"auto_map": {"AutoModel": "x.Y"}}, "auto_map"),
    ],
)
def test_unsupported_configs_fail_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf_dict(_hf_cfg(**change))


def test_layout_rules_name_the_numbers():
    spec = ModelSpec.from_hf_dict(_hf_cfg())
    assert check_layout(spec, tp=2, pp=2, world=8) == 2
    with pytest.raises(ConfigError, match="world size 6 .* 4"):
        check_layout(spec, tp=2, pp=2, world=6)
    with pytest.raises(ConfigError, match="num_key_value_heads=2 .* tensor_model_parallel_size=4"):
        check_layout(spec, tp=4, pp=1, world=4)
    with pytest.raises(ConfigError, match="num_hidden_layers=4 .* pipeline_model_parallel_size=3"):
        check_layout(spec, tp=1, pp=3, world=3)
    with pytest.raises(ConfigError, match="num_attention_heads=4 .* tensor_model_parallel_size=3"):
        check_layout(spec, tp=3, pp=1, world=3)


def test_missing_or_garbled_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json.* not found"):
        ModelSpec.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelSpec.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf_cfg()))
    assert ModelSpec.from_folder(tmp_path).num_layers == 4
