"""The torch_dist ``.metadata`` index (NeMo 2 weights) in both shapes torch pickles
``TensorProperties`` in: 5 items up to torch 2.14, 6 from torch 2.15 (``strides`` appended;
torch 2.15 torch/distributed/checkpoint/metadata.py:57-101). Each shape is made here by hand
from a checkpoint torch's own DCP writer saved, whatever torch runs the tests, so the default
suite (torch 2.13) reads the 2.15 shape and the py312 leg (torch 2.15) the older one.

The chunks an index lists are untrusted too: ones that overlap (reaching the element count with
parts of the tensor never written) or sit at a negative offset are refused.

Pickle is used only to WRITE test files from our own objects; the reader under test
(``formats.nemo2.DcpIndex``) unpickles through its allow-list."""

from __future__ import annotations

import io
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


W = "module.embedding.word_embeddings.weight"  # (6, 4) float32
STACKED = "module.decoder.layers.mlp.linear_fc2.weight"  # (2, 2, 4) bfloat16


def _with_chunks(weights, fqn, chunks):
    """Re-index ``fqn`` as ``chunks`` [(offsets, tensor)], stored in a ``.distcp`` of their own."""
    with open(weights / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written by torch in the fixture
    md.storage_meta = None  # a pathlib.Path, see _rewrite
    old = [k for k in md.storage_data if k.fqn == fqn]
    index_type, info_type = type(old[0]), type(md.storage_data[old[0]])
    for k in old:
        del md.storage_data[k]
    blob = bytearray()
    for i, (offsets, t) in enumerate(chunks):
        buf = io.BytesIO()
        torch.save(t.clone(), buf)
        md.storage_data[index_type(fqn, offsets, i)] = info_type(
            relative_path="__9_0.distcp", offset=len(blob), length=len(buf.getvalue())
        )
        blob += buf.getvalue()
    (weights / "__9_0.distcp").write_bytes(bytes(blob))
    (weights / ".metadata").write_bytes(pickle.dumps(md))
    return DcpIndex(weights)


def test_chunks_that_tile_a_tensor_read_back(saved, tmp_path):
    v = TENSORS[STACKED]
    index = _with_chunks(
        shutil.copytree(saved, tmp_path / "w"),
        STACKED,
        [((0, 1, 0), v[:, 1:]), ((0, 0, 0), v[:, :1])],
    )
    assert torch.equal(index.read(STACKED), v)
    assert torch.equal(index.read(STACKED, (1,)), v[1])


@pytest.mark.parametrize(
    "chunks,at",
    [
        # rows 0-3 and 2-3: 16 + 8 = all 24 elements counted, rows 4-5 never written
        ([((0, 0), slice(0, 4)), ((2, 0), slice(2, 4))], r"\[2, 0\]"),
        # columns 0-1, rows 0-2 of columns 1-2, rows 3-5 of columns 2-3: column 1 twice
        (
            [
                ((0, 0), (slice(None), slice(0, 2))),
                ((0, 1), (slice(0, 3), slice(1, 3))),
                ((3, 2), (slice(3, 6), slice(2, 4))),
            ],
            r"\[0, 1\]",
        ),
    ],
)
def test_overlapping_chunks_are_refused(chunks, at, saved, tmp_path):
    v = TENSORS[W]
    index = _with_chunks(
        shutil.copytree(saved, tmp_path / "w"), W, [(o, v[rows]) for o, rows in chunks]
    )
    with pytest.raises(
        ConfigError, match=rf"__9_0\.distcp'?: chunk of '{W}' at {at} overlaps another chunk of it"
    ):
        index.read(W)


def test_a_negative_chunk_offset_is_refused(saved, tmp_path):
    v = TENSORS[W]
    # [-3, 0] + 3 rows passes the end check, and narrow() would put the rows at 3-5
    index = _with_chunks(
        shutil.copytree(saved, tmp_path / "w"), W, [((0, 0), v[:3]), ((-3, 0), v[3:])]
    )
    with pytest.raises(
        ConfigError, match=rf"__9_0\.distcp'?: chunk of '{W}' at \[-3, 0\] has a negative offset"
    ):
        index.read(W)
