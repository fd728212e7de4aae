"""Input files the converter and the Megatron backend read back, damaged or of a kind the
weight table does not map, by hand: each is one ConfigError naming the file and the field or
tensor, before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nemo_d3s.convert import hf_to_megatron  # noqa: E402
from nemo_d3s.errors import ConfigError  # noqa: E402


def _refused(parent, match, fn, *args, **kw):
    before = sorted(os.listdir(parent))
    with pytest.raises(ConfigError, match=match):
        fn(*args, **kw)
    assert sorted(os.listdir(parent)) == before


def _hf_copy(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def test_fp8_weights_and_quantization_config_are_refused(tmp_path, made):
    """An FP8 checkpoint (F8_E4M3 weights, their weight_scale_inv beside them) would be cast
    to the run's dtype as garbage: the tensor's dtype and the config's quantization_config
    are each refused, naming file and tensor / field. With --dtype given (no stored dtype to
    keep) the header check is the only one the tensor meets."""
    from safetensors.torch import load_file, save_file

    src, _ = made
    fp8 = _hf_copy(src, tmp_path / "fp8")
    path = fp8 / "model.safetensors"
    t = load_file(str(path))
    name = "model.layers.0.mlp.gate_proj.weight"
    t[name] = t[name].to(torch.float8_e4m3fn)
    t[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(t, str(path), metadata={"format": "pt"})
    _refused(
        tmp_path,
        rf"fp8/model.safetensors'.*{name}' is F8_E4M3; expected F32, BF16, F16",
        hf_to_megatron,
        fp8,
        tmp_path / "out",
        dtype="bfloat16",
        progress=False,
    )
    quant = _hf_copy(src, tmp_path / "quant")
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quant / "config.json").write_text(json.dumps(cfg))
    _refused(
        tmp_path,
        r"quant/config.json: quantization_config is set",
        hf_to_megatron,
        quant,
        tmp_path / "out",
        progress=False,
    )


def test_an_index_naming_the_wrong_shard_names_index_and_shard(tmp_path, made):
    """model.safetensors.index.json mapping a tensor to a shard that does not hold it: one
    line naming both files (safetensors' own error named neither)."""
    from safetensors.torch import load_file, save_file

    src, _ = made
    split = _hf_copy(src, tmp_path / "split")
    t = load_file(str(split / "model.safetensors"))
    (split / "model.safetensors").unlink()
    names = sorted(t)
    half = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for f, keys in half.items():
        save_file({k: t[k] for k in keys}, str(split / f), metadata={"format": "pt"})
    weight_map = {k: f for f, keys in half.items() for k in keys}
    wrong = half["b.safetensors"][0]
    weight_map[wrong] = "a.safetensors"
    (split / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _refused(
        tmp_path,
        rf"index.json' maps tensor '{wrong}' to '.*split/a.safetensors', which does not hold it",
        hf_to_megatron,
        split,
        tmp_path / "out",
        progress=False,
    )


def _cut_vocab_rows(megatron, rows):
    """Every shard's embedding / output layer cut to ``rows`` rows: shards that agree with a
    layout.json whose padded vocabulary is ``rows`` x TP."""
    from safetensors.torch import load_file, save_file

    for f in sorted(megatron.glob("tp*.safetensors")):
        t = load_file(str(f))
        for k in t:
            if k.endswith(("word_embeddings.weight", "output_layer.weight")):
                t[k] = t[k][:rows].contiguous()
        save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "change,match",
    [
        ({"padded_vocab": 256}, r"TP2 x PP2 with padded vocabulary 256 is not a layout"),
        ({"tp": 0}, r"TP0 x PP2 with padded vocabulary \d+ is not a layout"),
        ({"pp": 0}, r"TP2 x PP0 with padded vocabulary \d+ is not a layout"),
    ],
)
def test_layout_json_sizes_are_checked_by_every_reader(tmp_path, made, change, match):
    """layout.json sizes that are not a layout of the model: the Megatron backend's load
    (prepare.open_weights) checked only its model fields, so a padded vocabulary short of the
    real one (256 < 300, shards that agree with it) left embedding rows 256.. unwritten
    (assemble_hf's new_empty), TP 0 divided by zero and PP 0 listed no shard to check."""
    from nemo_d3s.backends.megatron.prepare import open_weights
    from nemo_d3s.formats.spec import ModelSpec

    src, ck = made
    bad = Path(shutil.copytree(ck, tmp_path / "bad"))
    layout = bad / "megatron" / "layout.json"
    raw = json.loads(layout.read_text())
    layout.write_text(json.dumps({**raw, **change}))
    if "padded_vocab" in change:
        _cut_vocab_rows(bad / "megatron", change["padded_vocab"] // raw["tp"])
    spec = ModelSpec.from_folder(src)
    with pytest.raises(ConfigError, match=rf"bad/megatron/layout.json'.*{match}"):
        open_weights(str(bad), spec, object())
