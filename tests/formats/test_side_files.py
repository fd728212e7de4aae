"""One tokenizer rule for every reader of a model's side files (formats.side_files): the
converter's outputs and the Megatron backend's NeMo 2 training start both go through it."""

from __future__ import annotations

import json

import pytest

from nemo_d3s.convert import sources
from nemo_d3s.errors import ConfigError
from nemo_d3s.formats import nemo2
from nemo_d3s.formats.side_files import tokenizer_files


def test_the_tokenizer_rule(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"\(ctx\) has no tokenizer: missing tokenizer.json or"):
        tokenizer_files(tmp_path, role="ctx", hint="the way out")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {}}))
    (tmp_path / "notes.txt").write_text("not a tokenizer file")
    got = tokenizer_files(tmp_path, role="ctx", hint="the way out")
    assert sorted(p.name for p in got) == ["tokenizer.json", "tokenizer_config.json"]
    (tmp_path / "tokenizer.json").write_text("{garbled")
    with pytest.raises(ConfigError, match="tokenizer.json' is not valid JSON"):
        tokenizer_files(tmp_path, role="ctx", hint="the way out")


class _Seen(Exception):
    pass


def test_the_backend_and_the_converter_read_nemo2_side_files_the_same_way(tmp_path, monkeypatch):
    def spy(folder, *, hint):
        raise _Seen(hint)

    monkeypatch.setattr(nemo2, "nemo2_side_files", spy)
    monkeypatch.setattr(sources, "nemo2_side_files", spy)
    with pytest.raises(_Seen, match="megatron-to-hf --hf-config DIR"):
        nemo2.write_side_folder(tmp_path, tmp_path / "side")  # the backend's training start
    with pytest.raises(_Seen, match="pass --hf-config DIR"):
        sources._nemo_side_files(tmp_path)  # the converter


# ---------------------------------------------------------------- the weights' files
def test_one_hf_weights_writer_for_the_converter_and_the_backend(tmp_path):
    """formats.safetensors_stream.write_hf_weights: files of at most shard_bytes named as
    transformers names them, an index when there are several, tensors accepted in any order
    (the backend streams them in stage order); safetensors reads every tensor back."""
    import torch
    from safetensors.torch import load_file

    from nemo_d3s.formats.safetensors_stream import DEFAULT_SHARD_BYTES, write_hf_weights

    assert DEFAULT_SHARD_BYTES == 5 * 2**30
    ts = {f"w{i}": torch.full((2, 3), float(i)) for i in range(3)}  # 24 bytes each
    entries = [(n, (2, 3), torch.float32) for n in ts]
    where = write_hf_weights(tmp_path, reversed(list(ts.items())), entries, shard_bytes=48)
    assert where == {
        "w0": "model-00001-of-00002.safetensors",
        "w1": "model-00001-of-00002.safetensors",
        "w2": "model-00002-of-00002.safetensors",
    }
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 72}, "weight_map": where}
    for fname in set(where.values()):
        for n, t in load_file(tmp_path / fname).items():
            assert torch.equal(t, ts[n])
    one = tmp_path / "one"
    one.mkdir()
    write_hf_weights(one, ts.items(), entries)
    assert sorted(p.name for p in one.iterdir()) == ["model.safetensors"]
    with pytest.raises(ValueError, match="'extra' is not a tensor"):
        write_hf_weights(one, [("extra", torch.zeros(1))], entries)
    with pytest.raises(RuntimeError, match="never written"):
        write_hf_weights(one, list(ts.items())[:2], entries)
