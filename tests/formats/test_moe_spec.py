"""The mixture-of-experts rows of ``ModelSpec`` and of the layout check: Qwen3-MoE and
Mixtral configs as transformers 5 writes them, what is refused (dense layers between MoE
ones, router jitter, an EP the experts or the world do not divide), and the total vs active
parameter counts against transformers' own models."""

from __future__ import annotations

import pytest

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.spec import ModelSpec, check_layout

QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
MIXTRAL = dict(
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    vocab_size=300,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    num_local_experts=4,
    num_experts_per_tok=2,
    router_jitter_noise=0.0,
)


QWEN2_MOE = {  # Qwen3-MoE's fields less head_dim, with a shared expert and q/k/v biases
    **{k: v for k, v in QWEN3_MOE.items() if k != "head_dim"},
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "shared_expert_intermediate_size": 40,
    "norm_topk_prob": False,
    "qkv_bias": True,
}


def test_qwen2_moe_fields():
    """The shared expert's width, q/k/v biases from ``qkv_bias`` (no q/k norms), the
    unnormalised top-k, and the dense layers between MoE ones refused as for Qwen3-MoE."""
    q = ModelSpec.from_hf_dict(QWEN2_MOE)
    assert (q.num_experts, q.moe_ffn_hidden_size, q.moe_shared_ffn_hidden_size) == (8, 24, 40)
    assert q.moe_pre_softmax and q.qkv_bias and not q.qk_norm
    assert not ModelSpec.from_hf_dict({**QWEN2_MOE, "qkv_bias": False}).qkv_bias
    assert ModelSpec.from_hf_dict(QWEN3_MOE).moe_shared_ffn_hidden_size == 0
    with pytest.raises(ConfigError, match="dense layers"):
        ModelSpec.from_hf_dict({**QWEN2_MOE, "decoder_sparse_step": 2})
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        ModelSpec.from_hf_dict(
            {k: v for k, v in QWEN2_MOE.items() if k != "shared_expert_intermediate_size"}
        )
    check_layout(q, tp=2, pp=1, world=2, ep=1)  # the shared expert splits over TP: 40 / 2
    odd = ModelSpec.from_hf_dict({**QWEN2_MOE, "shared_expert_intermediate_size": 41})
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=41 is not divisible"):
        check_layout(odd, tp=2, pp=1, world=2, ep=1, etp=1)


def test_qwen3_moe_and_mixtral_fields():
    q = ModelSpec.from_hf_dict(QWEN3_MOE)
    assert (q.num_experts, q.moe_ffn_hidden_size, q.moe_topk, q.moe_pre_softmax) == (
        8,
        24,
        2,
        False,
    )
    assert q.qk_norm and not q.qkv_bias
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
    alt = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert ModelSpec.from_hf_dict(
        {**alt, "num_local_experts": 8, "norm_topk_prob": False}
    ).moe_pre_softmax
    m = ModelSpec.from_hf_dict(MIXTRAL)
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_topk, m.moe_pre_softmax) == (
        4,
        40,
        2,
        False,
    )
    assert not m.qk_norm


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({**QWEN3_MOE, "mlp_only_layers": [1]}, "dense layers between MoE layers"),
        ({**QWEN3_MOE, "decoder_sparse_step": 2}, "dense layers between MoE layers"),
        ({**QWEN3_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok=9 > num_experts=8"),
        ({**MIXTRAL, "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ],
)
def test_what_the_table_would_map_wrongly_is_refused(cfg, match):
    with pytest.raises(ConfigError, match=match):
        ModelSpec.from_hf_dict(cfg)


def test_expert_layouts_megatron_would_refuse_are_one_error():
    q = ModelSpec.from_hf_dict(QWEN3_MOE)
    assert check_layout(q, tp=1, pp=1, world=4, ep=4) == 4
    assert check_layout(q, tp=2, pp=1, world=4, ep=2) == 2  # ETP = TP: 2 x 2 x 1 fits 4
    with pytest.raises(
        ConfigError, match="num_experts=8 is not divisible by expert_model_parallel_size=3"
    ):
        check_layout(q, tp=1, pp=1, world=3, ep=3)
    with pytest.raises(
        ConfigError, match="world size 4 is not divisible by expert_tensor_parallel_size x"
    ):
        check_layout(q, tp=2, pp=1, world=4, ep=4)  # ETP 2 x EP 4 = 8
    with pytest.raises(ConfigError, match="moe_intermediate_size=24 is not divisible"):
        check_layout(q, tp=1, pp=1, world=16, ep=1, etp=16)
    with pytest.raises(ConfigError, match="use_tp_pp_dp_mapping"):
        check_layout(q, tp=2, pp=2, world=8, ep=2, etp=2, pp_last=False)
    dense = ModelSpec.from_hf_dict({**MIXTRAL, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ConfigError, match="has no experts"):
        check_layout(dense, tp=1, pp=1, world=2, ep=2)


@pytest.mark.parametrize(
    "cfg", [QWEN3_MOE, MIXTRAL, QWEN2_MOE], ids=["qwen3_moe", "mixtral", "qwen2_moe"]
)
def test_total_and_active_parameters_match_transformers(cfg):
    """Total = transformers' parameter count; active = total less the (E - k) experts a
    token does not use in each layer, counted by hand from the expert tensors' shapes (a
    shared expert is active: not among them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = ModelSpec.from_hf_dict(cfg)
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields))
    total = sum(p.numel() for p in model.parameters())
    assert spec.num_params == total
    per_expert = sum(p[0].numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert //= spec.num_layers
    unused = spec.num_layers * (spec.num_experts - spec.moe_topk) * per_expert
    assert spec.active_params == total - unused < total


@pytest.mark.parametrize(
    "cfg, refused",
    [
        ({**QWEN3_MOE, "num_experts_per_tok": 1}, True),  # norm_topk_prob: a weight of 1
        ({**QWEN3_MOE, "num_experts_per_tok": 1, "norm_topk_prob": False}, False),
        ({**MIXTRAL, "num_experts_per_tok": 1}, True),  # Mixtral always renormalises
        (QWEN3_MOE, False),
    ],
)
def test_a_top1_renormalised_router_is_refused_before_megatron_core_does(cfg, refused):
    """megatron-core raises "Please use --moe-router-pre-softmax when topk is 1" when the model
    is built (0.16.1 transformer_config.py:1633-1641); the mapping passed every earlier
    check, and hf-to-megatron-lm wrote args Megatron-LM refuses. Refused first now, with the
    backend that runs such a model."""
    from nemo_d3s.backends.megatron.moe import check_moe_layout
    from nemo_d3s.formats.moe import moe_transformer_fields

    spec = ModelSpec.from_hf_dict(cfg)
    if not refused:
        check_moe_layout(spec, tp=1, sequence_parallel=False)
        assert moe_transformer_fields(spec)["moe_router_topk"] == spec.moe_topk
        return
    for call in (
        lambda: check_moe_layout(spec, tp=1, sequence_parallel=False),
        lambda: moe_transformer_fields(spec),
    ):
        with pytest.raises(ConfigError, match="num_experts_per_tok=1 with the routing weight"):
            call()
    ModelSpec.from_hf_dict(cfg)  # the spec itself stands: the HF backend runs it


def test_the_refused_router_is_the_one_megatron_core_refuses():
    """The rule above against megatron-core's own TransformerConfig check."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8)
    base.update(moe_router_score_function="softmax", moe_ffn_hidden_size=24)
    for pre, ok in ((False, False), (True, True)):
        try:
            TransformerConfig(**base, moe_router_topk=1, moe_router_pre_softmax=pre)
        except ValueError as e:
            assert not ok and "pre-softmax when topk is 1" in str(e)
        else:
            assert ok


def test_expert_weights_megatron_core_would_reduce_as_dense_are_refused():
    """At EP 1 megatron-core marks expert weights ``allreduce`` like dense ones (0.16.1
    ``tensor_parallel/layers.py:829,886``), so Megatron's DDP and distributed optimizer reduce
    and shard them over DP x CP, not the expert-data-parallel group: right only when ETP = TP.
    The plain optimizer reduces experts over their own group and stays allowed."""
    from nemo_d3s.backends.megatron.moe import check_moe_layout

    q = ModelSpec.from_hf_dict(QWEN3_MOE)
    layouts = [(2, 1, 1), (1, 1, 2)]  # (tp, ep, etp): ETP below and above TP at EP 1
    for tp, ep, etp in layouts:
        with pytest.raises(ConfigError, match=f"expert_tensor_parallel_size={etp} != tensor"):
            check_moe_layout(
                q, tp=tp, sequence_parallel=True, ep=ep, etp=etp, distributed_optimizer=True
            )
        check_moe_layout(
            q, tp=tp, sequence_parallel=True, ep=ep, etp=etp, distributed_optimizer=False
        )
    for tp, ep, etp in [(2, 1, None), (2, 1, 2), (2, 2, 1), (4, 8, 1)]:  # ETP = TP, or EP > 1
        check_moe_layout(
            q, tp=tp, sequence_parallel=True, ep=ep, etp=etp, distributed_optimizer=True
        )
