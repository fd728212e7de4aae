"""Model folders for the conversion tests: the Megatron tests' tiny HF folders (Llama: GQA,
untied; Qwen2: q/k/v bias, tied; vocabulary 300, padded by every layout) in float32 or
bfloat16, and helpers to compare HF folders tensor by tensor."""

from __future__ import annotations

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


def tiny(folder, arch: str, dtype: str = "float32", seed: int = 0) -> Path:
    """A tiny HF folder of ``arch`` ("llama" untied, "qwen2" tied) stored in ``dtype``."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_hf(folder, arch, tied=arch == "qwen2", seed=seed)
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
