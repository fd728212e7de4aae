"""HF -> Megatron (TP1/PP1, TP2/PP2) -> HF is bit-exact for float32 and bfloat16, for a
Llama-type model (GQA, untied) and a Qwen2-type model (q/k/v bias, tied), both with a
vocabulary the layouts pad; config.json comes back byte for byte; the shard files hold what
the weight table says; the output follows the process umask; the embedded SmolLM2 round
trips too (slow)."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import assert_same_tensors, hf_tensors, tiny  # noqa: E402

from nemo_d3s.formats.spec import ModelSpec  # noqa: E402
from nemo_d3s.formats.weights import Layout, SafetensorsReader, local_names, read_local  # noqa: E402
from nemo_d3s.convert import hf_to_megatron, megatron_to_hf  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_round_trip_is_bit_exact(tmp_path, arch, dtype, tp, pp):
    src = tiny(tmp_path / "src", arch, dtype)
    ck = hf_to_megatron(src, tmp_path / "ck", tp=tp, pp=pp, progress=False)
    layout = json.loads((ck / "megatron" / "layout.json").read_text())
    assert (layout["tp"], layout["pp"], layout["padded_vocab"]) == (tp, pp, 128 * tp * -(-300 // (128 * tp)))
    assert sorted(os.listdir(ck / "megatron")) == ["layout.json"] + [
        f"tp{t:02d}_pp{p:02d}.safetensors" for t in range(tp) for p in range(pp)]
    back = megatron_to_hf(ck, tmp_path / "back", progress=False)
    assert_same_tensors(src, back)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (back / name).read_bytes() == (src / name).read_bytes(), name
    assert not (back / "model.safetensors.index.json").exists()
    # transformers loads it, in the stored dtype
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(back))
    assert model.dtype == getattr(torch, dtype)


def test_shards_hold_what_the_table_says(tmp_path):
    """Every shard file tensor equals weights.read_local at its position, padding rows
    included (zeros), and the tensors keep the stored dtype."""
    from safetensors.torch import load_file

    src = tiny(tmp_path / "src", "qwen2", "bfloat16")
    ck = hf_to_megatron(src, tmp_path / "ck", tp=2, pp=2, progress=False)
    spec = ModelSpec.from_folder(src)
    reader = SafetensorsReader(src, spec)
    layout = Layout(2, 2, padded_vocab=512)
    for p in range(2):
        for t in range(2):
            lay = layout.at(t, p)
            got = load_file(str(ck / "megatron" / f"tp{t:02d}_pp{p:02d}.safetensors"))
            assert sorted(got) == sorted(local_names(spec, lay))
            for name, tensor in got.items():
                assert tensor.dtype == torch.bfloat16
                assert torch.equal(tensor, read_local(name, spec, lay, reader, torch.bfloat16)), name
    emb = load_file(str(ck / "megatron" / "tp01_pp00.safetensors"))["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 32) and not emb[300 - 256:].any()  # rows past the real vocabulary


def test_dtype_cast_and_sharded_output(tmp_path):
    """--dtype on the way in and out; a small --max-shard-size gives an index that
    transformers loads; config.json states the dtype written."""
    src = tiny(tmp_path / "src", "llama")
    ck = hf_to_megatron(src, tmp_path / "ck", tp=2, pp=1, dtype="bfloat16", progress=False)
    assert json.loads((ck / "config.json").read_text())["dtype"] == "bfloat16"
    back = megatron_to_hf(ck, tmp_path / "back", dtype="float32", max_shard_bytes=40_000, progress=False)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    got, want = hf_tensors(back), hf_tensors(src)
    assert sorted(got) == sorted(index["weight_map"]) == sorted(want)
    for k in want:
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], want[k].to(torch.bfloat16).float()), k
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in got.values())
    assert json.loads((back / "config.json").read_text())["dtype"] == "float32"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(back))
    assert torch.equal(model.lm_head.weight, got["lm_head.weight"])


def test_output_follows_the_umask(tmp_path):
    src = tiny(tmp_path / "src", "llama")
    old = os.umask(0o027)
    try:
        ck = hf_to_megatron(src, tmp_path / "ck", progress=False)
        back = megatron_to_hf(ck, tmp_path / "back", progress=False)
    finally:
        os.umask(old)
    for root in (ck, back):
        for dirpath, _, files in os.walk(root):
            assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o750, dirpath
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode) == 0o640, f


def test_overwrite_replaces_and_leaves_no_temporary_folder(tmp_path):
    src = tiny(tmp_path / "src", "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    hf_to_megatron(src, out, overwrite=True, progress=False)
    assert not (out / "stale.txt").exists() and (out / "megatron" / "layout.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]
    empty = tmp_path / "empty"
    empty.mkdir()
    hf_to_megatron(src, empty, progress=False)  # an empty folder is not "non-empty"
    nested = megatron_to_hf(out, tmp_path / "a" / "b" / "hf", progress=False)
    assert (nested / "model.safetensors").is_file()


@pytest.mark.slow
def test_smollm2_round_trip(tmp_path):
    """The embedded SmolLM2-135M (tied, 9 heads / 3 kv heads, 30 layers) at TP1 x PP1 and
    TP3 x PP2, back bit for bit."""
    from nemo_d3s.backends.hf.loading import resolve_model_path

    src = resolve_model_path("smollm2-135m-instruct")
    for tp, pp in ((1, 1), (3, 2)):
        ck = hf_to_megatron("smollm2-135m-instruct", tmp_path / f"ck{tp}{pp}", tp=tp, pp=pp, progress=False)
        back = megatron_to_hf(ck, tmp_path / f"back{tp}{pp}", progress=False)
        assert_same_tensors(src, back)
        assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
        assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
