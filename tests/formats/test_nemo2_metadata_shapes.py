"""The torch_dist ``.metadata`` index (NeMo 2 weights) in both shapes torch pickles
``TensorProperties`` in: 5 items up to torch 2.14, 6 from torch 2.15 (``strides`` appended;
torch 2.15 torch/distributed/checkpoint/metadata.py:57-101). Each shape is made here by hand
from a checkpoint torch's own DCP writer saved, whatever torch runs the tests, so the default
suite (torch 2.13) reads the 2.15 shape and the py312 leg (torch 2.15) the older one.

Pickle is used only to WRITE test files from our own objects; the reader under test
(``formats.nemo2.DcpIndex``) unpickles through its allow-list."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.nemo2 import DcpIndex

TENSORS = {
    "module.embedding.word_embeddings.weight": torch.arange(24, dtype=torch.float32).view(6, 4),
    "module.decoder.layers.mlp.linear_fc2.weight": torch.arange(16, dtype=torch.bfloat16).view(
        2, 2, 4
    ),
}


def _properties_state(props, items):
    """``TensorProperties.__getstate__`` as torch writes it: ``items`` 5 (<= 2.14), 6 (>= 2.15)."""
    enc = dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    head = (props.dtype, props.layout, props.requires_grad, enc, props.pin_memory)
    if items == 5:
        return head
    strides = getattr(props, "strides", None)
    return head + (strides if strides is not None else (4, 1),)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    weights = tmp_path_factory.mktemp("dcp") / "weights"
    dcp.save({k: v.clone() for k, v in TENSORS.items()}, checkpoint_id=str(weights), no_dist=True)
    (weights / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return weights


def _rewrite(weights, monkeypatch, state):
    """Re-pickle ``weights/.metadata`` with ``state(props)`` as TensorProperties' pickled state."""
    with open(weights / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written just above by torch
    # dcp.save's own writer records its checkpoint_id as a pathlib.Path, which the allow-list
    # refuses (megatron-core's writer, NeMo's, records no path object)
    md.storage_meta = None
    monkeypatch.setattr(dcp_metadata.TensorProperties, "__getstate__", state)
    (weights / ".metadata").write_bytes(pickle.dumps(md))
    monkeypatch.undo()
    return weights


@pytest.mark.parametrize("items", [5, 6])
def test_both_shapes_read_the_same_tensors(items, saved, tmp_path, monkeypatch):
    weights = _rewrite(
        shutil.copytree(saved, tmp_path / "w"), monkeypatch, lambda p: _properties_state(p, items)
    )
    raw = (weights / ".metadata").read_bytes()
    index = DcpIndex(weights)
    assert {k: v for k, v in index.tensors.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in TENSORS.items()
    }
    for k, v in TENSORS.items():
        assert torch.equal(index.read(k), v)
    # the file really holds that shape: the states torch's unpickling hands TensorProperties
    seen = []
    monkeypatch.setattr(
        dcp_metadata.TensorProperties, "__setstate__", lambda self, state: seen.append(len(state))
    )
    pickle.loads(raw)
    assert set(seen) == {items}


@pytest.mark.parametrize(
    "strides,match",
    [
        ((4, "1"), r"strides \(4, '1'\) are not ints"),
        ([4, 1], r"strides \[4, 1\] are not ints"),
    ],
)
def test_bad_strides_are_refused(strides, match, saved, tmp_path, monkeypatch):
    weights = _rewrite(
        shutil.copytree(saved, tmp_path / "w"),
        monkeypatch,
        lambda p: _properties_state(p, 5) + (strides,),
    )
    with pytest.raises(ConfigError, match=r"\.metadata.*not a readable NeMo 2.*" + match):
        DcpIndex(weights)


def test_a_shape_torch_never_wrote_is_refused(saved, tmp_path, monkeypatch):
    weights = _rewrite(
        shutil.copytree(saved, tmp_path / "w"),
        monkeypatch,
        lambda p: _properties_state(p, 6) + ("extra",),
    )
    with pytest.raises(ConfigError, match=r"TensorProperties of 7 items \(torch reads 5 or 6\)"):
        DcpIndex(weights)
