"""``formats.detect_format``: the one function that tells a Hugging Face folder, a Megatron
checkpoint (training or converted), a NeMo 2 checkpoint and a Megatron-LM / Megatron-Bridge
checkpoint apart, and the only place that looks for their marker files."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from nemo_d3s.formats.detect import (
    HF,
    MEGATRON,
    MEGATRON_LM,
    NEMO2,
    FolderFormat,
    detect_format,
)
from nemo_d3s.formats.spec import ModelSpec

PKG = Path(__file__).resolve().parents[2] / "nemo_d3s"

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
}


def _touch(path: Path, text: str = "{}") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_each_kind_by_its_marker_files(tmp_path):
    hf = tmp_path / "hf"
    _touch(hf / "config.json")
    assert detect_format(hf) == FolderFormat(None, hf)  # a config alone (the dry run's recipes)
    _touch(hf / "model.safetensors", "")
    assert detect_format(hf) == FolderFormat(HF, hf)
    sharded = tmp_path / "sharded"
    _touch(sharded / "config.json")
    _touch(sharded / "model.safetensors.index.json")
    assert detect_format(sharded).kind == HF

    step = tmp_path / "step_000002"
    _touch(step / "megatron" / "layout.json")
    got = detect_format(step)
    assert (got.kind, got.folder, got.shards, got.training) == (
        MEGATRON,
        step,
        step / "megatron",
        False,
    )
    assert (
        detect_format(step / "megatron") == got
    )  # the megatron/ folder itself names the same checkpoint
    _touch(step / "checksums.json")  # converted checkpoints carry checksums too
    assert not detect_format(step).training
    _touch(step / "trainer_state.json")
    assert detect_format(step).training

    nemo = tmp_path / "nemo"
    _touch(nemo / "weights" / "metadata.json")
    assert detect_format(nemo).kind is None  # no context/
    (nemo / "context").mkdir()
    assert detect_format(nemo) == FolderFormat(NEMO2, nemo)
    assert detect_format(tmp_path / "missing").kind is None

    # Megatron-LM / Megatron-Bridge: a save folder (its tracker) or one iteration's folder
    save = tmp_path / "save"
    it = save / "iter_0000100"
    for name in ("metadata.json", ".metadata"):
        _touch(it / name)
    assert detect_format(it).kind is None  # no common.pt: not a dist_checkpointing folder
    _touch(it / "common.pt", "")
    assert detect_format(it) == FolderFormat(MEGATRON_LM, it)
    assert detect_format(save).kind is None
    _touch(save / "latest_checkpointed_iteration.txt", "100")
    assert detect_format(save) == FolderFormat(MEGATRON_LM, save)
    # NeMo 2's weights/ alone is a dist_checkpointing folder too; the NeMo 2 folder wins
    _touch(nemo / "weights" / ".metadata")
    _touch(nemo / "weights" / "common.pt")
    assert detect_format(nemo).kind == NEMO2


def test_model_spec_reads_the_config_the_detected_kind_holds(tmp_path):
    hf = tmp_path / "hf"
    _touch(hf / "config.json", json.dumps(LLAMA))
    assert ModelSpec.from_folder(hf).num_layers == 2
    nemo = tmp_path / "nemo"
    _touch(nemo / "weights" / "metadata.json")
    _touch(
        nemo / "context" / "model.yaml",
        "config:\n  _target_: nemo.collections.llm.gpt.model.llama.Llama3Config\n"
        "  num_layers: 3\n  hidden_size: 8\n  ffn_hidden_size: 16\n  num_attention_heads: 2\n"
        "  num_query_groups: 1\n  vocab_size: 32\n  seq_length: 64\n  layernorm_epsilon: 1.0e-05\n",
    )
    assert ModelSpec.from_folder(nemo).num_layers == 3  # context/model.yaml, not a config.json


def _code_strings(path: Path):
    """String constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
        ):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.value


@pytest.mark.parametrize(
    "marker", ["layout.json", "metadata.json", "latest_checkpointed_iteration.txt", "common.pt"]
)
def test_no_module_outside_formats_looks_for_a_marker_file(marker):
    found = [
        str(p.relative_to(PKG))
        for p in sorted(PKG.rglob("*.py"))
        if "formats" not in p.parts
        and any(s == marker or s.endswith("/" + marker) for s in _code_strings(p))
    ]
    assert found == []
