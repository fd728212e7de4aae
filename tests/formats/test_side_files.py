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
