"""A Megatron-LM / Megatron-Bridge folder written by ``hf-to-megatron-lm`` holds every key of
the state dict megatron-core's Transformer Engine spec loads (Llama; Qwen3 with q / k norms;
Qwen3-MoE and Qwen2-MoE with the grouped-GEMM experts), ``_extra_state`` objects included,
so a strict load with the TE spec finds nothing missing.

Transformer Engine does not import here, so the expected keys are computed from megatron-core's
own spec: ``get_gpt_layer_with_transformer_engine_spec`` with megatron-core's TE wrapper
classes as it defines them without TE (``extensions/transformer_engine.py`` binds ``te`` to a
MagicMock), its ``TESpecProvider`` put where its import would have put it, and a TE version
for its checks. The module tree is megatron-core's; what each TE class stores (its parameters
for a bias-free RMSNorm model, plus ``_extra_state``) is the table below, read from TE:
``TransformerEngineBaseModule.get_extra_state`` (the linears, the attention), and TE's
``RMSNorm(_RMSNormOp)`` (``pytorch/module/rmsnorm.py``), a fusible op whose
``BasicOperation.get_extra_state`` (``pytorch/ops/op.py``) puts ``_extra_state`` in its state
dict. Runs on megatron-core 0.16 here and 0.19 in CI's Python 3.12 environment.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _models import tiny  # noqa: E402

from nemo_d3s.convert.mcore import hf_to_megatron_lm  # noqa: E402
from nemo_d3s.formats.nemo2 import DcpIndex  # noqa: E402
from nemo_d3s.formats.spec import ModelSpec  # noqa: E402

# What each of megatron-core's TE classes stores for a model without biases (RMSNorm).
TE_STATE = {
    "TELayerNormColumnParallelLinear": ("layer_norm_weight", "weight", "_extra_state"),
    "TEColumnParallelLinear": ("weight", "_extra_state"),
    "TERowParallelLinear": ("weight", "_extra_state"),
    "TEDotProductAttention": ("_extra_state",),
    "TENorm": ("weight", "_extra_state"),
    # TEGroupedMLP's grouped GEMMs: weight<k> and one extra state per local expert, saved under
    # the MLP's ``experts.`` prefix with an expert axis (megatron-core 0.16.1
    # extensions/transformer_engine.py :1738-1790; transformer/moe/experts.py :768-806)
    "TEColumnParallelGroupedLinear": ("weight", "_extra_state"),
    "TERowParallelGroupedLinear": ("weight", "_extra_state"),
}
GROUPED = ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")


@pytest.fixture
def te_layer_spec(monkeypatch):
    """megatron-core's TE layer spec function, callable without TE."""
    from packaging.version import Version

    import megatron.core.extensions.transformer_engine as ext
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.utils as mutils
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    monkeypatch.setattr(mutils, "_te_version", Version("2.9.0"), raising=False)
    monkeypatch.setattr(specs, "TESpecProvider", TESpecProvider, raising=False)
    monkeypatch.setattr(specs, "TENorm", ext.TENorm, raising=False)
    # without TE the grouped linears are None and the MoE spec falls back to the legacy
    # GroupedMLP: stand-ins put TEGroupedMLP in the tree, as with TE >= 1.9
    import megatron.core.extensions.transformer_engine_spec_provider as provider

    for cls in GROUPED:
        monkeypatch.setattr(provider, cls, type(cls, (), {}), raising=False)
    names = {id(v): k for k, v in vars(ext).items() if k in TE_STATE and v is not None}
    names.update({id(getattr(provider, cls)): cls for cls in GROUPED})
    # megatron-core 0.19 builds a MoE layer's pre-MLP norm as TENorm(has_residual=True) through
    # an adapter class (transformer_engine_spec_provider.py:29-33, :69): TENorm's state
    residual = getattr(provider, "_TENormWithResidual", None)
    if residual is not None:
        names[id(residual)] = "TENorm"
    return specs.get_gpt_layer_with_transformer_engine_spec, names


def _te_slots(spec, names, path=""):
    """(submodule path, TE class name) of every TE module in a ModuleSpec tree."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if id(module) in names:
        return [(path, names[id(module)])]
    sub = spec.submodules if isinstance(spec, ModuleSpec) else None
    if isinstance(spec, functools.partial):
        # megatron-core 0.19 builds the MLP as ``partial(MLP.as_mlp_submodule, submodules=...)``
        # (gpt_layer_specs.get_mlp_module_spec_for_backend), not a ModuleSpec
        sub = spec.keywords.get("submodules")
    if sub is None or not dataclasses.is_dataclass(sub):
        return []
    out = []
    for f in dataclasses.fields(sub):
        out += _te_slots(getattr(sub, f.name), names, f"{path}{f.name}.")
    return out


def te_spec_keys(spec: ModelSpec, layer_spec_fn, names):
    """(tensor keys, object keys) a TE-spec GPTModel of ``spec`` saves at TP1 PP1, as a DCP
    index names them: layers stacked under ``decoder.layers.``, each ShardedObject once per
    layer (``/shard_<i>_<L>``); the final norm is ``LayerNormImpl``, TENorm under TE
    (``transformer_block.py``); GPTModel drops the output layer's (empty) extra state."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import transformer_block

    assert "LayerNormImpl = TENorm" in inspect.getsource(transformer_block)
    assert "output_layer._extra_state" in inspect.getsource(gpt_model)
    L = spec.num_layers
    tensors = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not spec.tie_word_embeddings:
        tensors.add("output_layer.weight")
    objects = {"decoder.final_layernorm._extra_state/shard_0_1"}
    moe = dict(num_experts=spec.num_experts, moe_grouped_gemm=True) if spec.num_experts else {}
    slots = _te_slots(layer_spec_fn(qk_layernorm=spec.qk_norm, **moe), names)
    E = spec.num_experts
    for path, cls in slots:
        if path.startswith("mlp.shared_experts.") and not spec.moe_shared_ffn_hidden_size:
            continue  # MoELayer builds it only for a shared width (0.16.1 moe_layer.py:105)
        grouped = cls in GROUPED  # mlp.experts.linear_fc<i> -> mlp.experts.experts.linear_fc<i>
        prefix = f"mlp.experts.experts.{path.split('.')[-2]}." if grouped else path
        shards = [f"{i}.{e}_{L}.{E}" for i in range(L) for e in range(E)] if grouped else None
        for item in TE_STATE[cls]:
            key = f"decoder.layers.{prefix}{item}"
            if item == "_extra_state":
                objects |= {f"{key}/shard_{x}" for x in shards or (f"{i}_{L}" for i in range(L))}
            else:
                tensors.add(key)
    if spec.num_experts:  # built by MoELayer / SharedExpertMLP themselves, not by the spec
        tensors.add("decoder.layers.mlp.router.weight")
        if spec.moe_shared_ffn_hidden_size:
            tensors.add("decoder.layers.mlp.shared_experts.gate_weight")
    if spec.qkv_bias:  # TE's fused linear keeps its bias beside the weight
        tensors.add("decoder.layers.self_attention.linear_qkv.bias")
    return tensors, objects, dict(slots)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_megatron_lm_writer_holds_every_key_of_the_te_spec(arch, te_layer_spec, tmp_path):
    src = tiny(tmp_path / "src", arch)
    spec = ModelSpec.from_folder(src)
    tensors, objects, slots = te_spec_keys(spec, *te_layer_spec)
    # the spec walked is megatron-core's TE layer: fused input norms, TE attention, and the
    # q / k norms exactly where the model has them
    assert slots["self_attention.linear_qkv."] == "TELayerNormColumnParallelLinear"
    assert slots["self_attention.core_attention."] == "TEDotProductAttention"
    assert slots["mlp.linear_fc1."] == "TELayerNormColumnParallelLinear"
    assert ("self_attention.q_layernorm." in slots) == (arch == "qwen3") == spec.qk_norm
    out = hf_to_megatron_lm(src, tmp_path / "out", progress=False)
    index = DcpIndex(out / "release")
    assert tensors - set(index.tensors) == set()
    assert objects - set(index.objects) == set()
    assert set(index.tensors) == tensors  # and no tensor the TE model would not load
    qk = {f"decoder.layers.self_attention.{n}_layernorm._extra_state/shard_1_4" for n in "qk"}
    assert qk <= objects if arch == "qwen3" else not qk & objects


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_the_megatron_lm_writer_holds_every_key_of_the_te_moe_spec(arch, te_layer_spec, tmp_path):
    """The TE spec's MoE layer: an unfused TENorm before it, TEGroupedMLP's grouped GEMMs (one
    extra state per layer and expert), SharedExpertMLP's TE linears for Qwen2-MoE."""
    src = tiny(tmp_path / "src", arch)
    spec = ModelSpec.from_folder(src)
    tensors, objects, slots = te_spec_keys(spec, *te_layer_spec)
    assert slots["pre_mlp_layernorm."] == "TENorm"
    assert slots["mlp.experts.linear_fc1."] == "TEColumnParallelGroupedLinear"
    assert slots["mlp.experts.linear_fc2."] == "TERowParallelGroupedLinear"
    assert slots["mlp.shared_experts.linear_fc1."] == "TEColumnParallelLinear"
    shared = "decoder.layers.mlp.shared_experts.linear_fc1.weight"
    assert (shared in tensors) == (arch == "qwen2_moe")
    assert "mlp.linear_fc1." not in slots
    out = hf_to_megatron_lm(src, tmp_path / "out", progress=False)
    index = DcpIndex(out / "release")
    assert tensors - set(index.tensors) == set()
    assert objects - set(index.objects) == set()
    assert set(index.tensors) == tensors
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_3.3_4.4" in objects
