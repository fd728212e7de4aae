"""Model folders for the conversion tests: the Megatron tests' tiny HF folders (Llama: GQA,
untied; Qwen2: q/k/v bias, tied; Qwen3: q/k norms, tied here; vocabulary 300, padded by
every layout) in float32 or bfloat16, and helpers to compare HF folders tensor by tensor."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "backends", "megatron"))
sys.path.insert(0, os.path.join(HERE, "..", "distributed"))
from _tiny_hf import make_tiny_hf  # noqa: E402


def tiny(folder, arch: str, dtype: str = "float32", seed: int = 0, tied=None) -> Path:
    """A tiny HF folder of ``arch`` ("llama" untied, "qwen2" / "qwen3" tied unless ``tied``
    says otherwise) stored in ``dtype``."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_hf(
        folder, arch, tied=arch in ("qwen2", "qwen3") if tied is None else tied, seed=seed
    )
    if dtype != "float32":
        path = folder / "model.safetensors"
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
        cfg = json.loads((folder / "config.json").read_text())
        cfg["dtype"] = dtype
        (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return folder


def hf_tensors(folder) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF folder (one file or an indexed set)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    out: Dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(a, b) -> None:
    ta, tb = hf_tensors(a), hf_tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype, k
        assert torch.equal(ta[k], tb[k]), k


def nemo_context(hf_folder, dst) -> Path:
    """A NeMo 2 ``context/`` for the HF model ``hf_folder`` as NeMo's importer writes it (the
    fields nemo_d3s reads of ``model.yaml``, ``nemo_tokenizer/``, ``artifacts/``), for tests
    without nemo-toolkit. Returns the folder holding ``context/``."""
    import shutil

    import yaml

    hf_folder, dst = Path(hf_folder), Path(dst)
    cfg = json.loads((hf_folder / "config.json").read_text())
    arch = cfg["architectures"][0]
    qwen = arch == "Qwen2ForCausalLM"
    qwen3 = arch == "Qwen3ForCausalLM"
    module = "qwen2.Qwen2Config" if qwen else "qwen3.Qwen3Config" if qwen3 else "llama.LlamaConfig"
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    config = {
        "_target_": f"nemo.collections.llm.gpt.model.{module}",
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_query_groups": cfg["num_key_value_heads"],
        "kv_channels": cfg.get("head_dim"),
        "layernorm_epsilon": cfg["rms_norm_eps"],
        "rotary_base": cfg.get("rope_theta", 10000.0),
        "seq_length": cfg["max_position_embeddings"],
        "vocab_size": cfg["vocab_size"],
        "share_embeddings_and_output_weights": cfg.get("tie_word_embeddings", False),
        "make_vocab_size_divisible_by": 4,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "position_embedding_type": "rope",
        "add_bias_linear": False,
        "add_qkv_bias": qwen,
        "qk_layernorm": qwen3,
        "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
        "params_dtype": {"_target_": f"torch.{dtype}", "_call_": False},
        "bf16": dtype == "bfloat16",
        "init_method_std": cfg.get("initializer_range", 0.02),
    }
    ctx = dst / "context"
    (ctx / "nemo_tokenizer").mkdir(parents=True)
    (ctx / "artifacts").mkdir()
    kind = "qwen2.Qwen2Model" if qwen else "qwen3.Qwen3Model" if qwen3 else "llama.LlamaModel"
    (ctx / "model.yaml").write_text(
        yaml.safe_dump({"_target_": f"nemo.collections.llm.gpt.model.{kind}", "config": config})
    )
    (ctx / "io.json").write_text("{}")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(hf_folder / name, ctx / "nemo_tokenizer" / name)
    shutil.copyfile(
        hf_folder / "generation_config.json", ctx / "artifacts" / "generation_config.json"
    )
    return dst


def megatron_lm_args_for(cfg, tp, pp, padded):
    """The args Megatron-LM's arguments.py would have for this HF config (its own names),
    with one of megatron-core's enums, as a real run's namespace holds."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        group_query_attention=True,
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        norm_epsilon=cfg["rms_norm_eps"],
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=cfg["architectures"] == ["Qwen3ForCausalLM"],
        position_embedding_type="rope",
        rotary_base=int(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]),
        rotary_percent=1.0,
        max_position_embeddings=cfg["max_position_embeddings"],
        vocab_size=cfg["vocab_size"],
        padded_vocab_size=padded,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        bf16=False,
        attention_backend=AttnBackend.auto,
        tokenizer_type="HuggingFaceTokenizer",
    )
