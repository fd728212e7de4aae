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

from nemo_d3s.convert import hf_to_megatron, megatron_to_hf  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_round_trip_is_bit_exact(tmp_path, arch, dtype, tp, pp):
    src = tiny(tmp_path / "src", arch, dtype)
    ck = hf_to_megatron(src, tmp_path / "ck", tp=tp, pp=pp, progress=False)
    layout = json.loads((ck / "megatron" / "layout.json").read_text())
    assert (layout["tp"], layout["pp"], layout["padded_vocab"]) == (
        tp,
        pp,
        128 * tp * -(-300 // (128 * tp)),
    )
    assert sorted(os.listdir(ck / "megatron")) == ["layout.json"] + [
        f"tp{t:02d}_pp{p:02d}.safetensors" for t in range(tp) for p in range(pp)
    ]
    back = megatron_to_hf(ck, tmp_path / "back", progress=False)
    assert_same_tensors(src, back)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (back / name).read_bytes() == (src / name).read_bytes(), name
    assert not (back / "model.safetensors.index.json").exists()
    # transformers loads it, in the stored dtype
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(back))
    assert model.dtype == getattr(torch, dtype)


def megatron_shards_by_hand(hf, cfg, tp: int, pp: int, padded_vocab: int):
    """{(tp rank, pp stage): {name: tensor}} for a Llama / Qwen2 / Qwen3 HF state dict, written from
    megatron-core's GPTModel conventions (local layer spec) without the weight table:
    layers numbered per stage; q/k/v fused per query group ([q of the group's heads; k; v]
    for each KV head) and the groups split over TP; o_proj and down_proj split by columns;
    gate and up each split by rows, then [gate shard; up shard]; the vocabulary padded with
    zero rows to ``padded_vocab`` and split by rows; the output layer on the last stage,
    except when tied at PP 1 (the embedding itself serves; at PP > 1 the last stage holds
    its own copy); Qwen3's q_norm / k_norm whole on every TP rank as q_layernorm / k_layernorm."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    per_stage, vocab = cfg["num_hidden_layers"] // pp, cfg["vocab_size"]

    def padded(w):
        out = torch.zeros(padded_vocab, h, dtype=w.dtype)
        out[:vocab] = w
        return out

    def qkv(kind):
        q = hf[f"{pre}self_attn.q_proj.{kind}"].reshape(kv, heads // kv * d, -1)
        k = hf[f"{pre}self_attn.k_proj.{kind}"].reshape(kv, d, -1)
        v = hf[f"{pre}self_attn.v_proj.{kind}"].reshape(kv, d, -1)
        fused = torch.cat([q, k, v], dim=1).chunk(tp, dim=0)[t]
        return fused.reshape(-1, h) if kind == "weight" else fused.reshape(-1)

    emb = padded(hf["model.embed_tokens.weight"])
    tied = "lm_head.weight" not in hf
    out_w = emb if tied else padded(hf["lm_head.weight"])
    shards = {}
    for p in range(pp):
        for t in range(tp):
            s = {}
            if p == 0:
                s["embedding.word_embeddings.weight"] = emb.chunk(tp, 0)[t]
            for j in range(per_stage):
                pre, me = f"model.layers.{p * per_stage + j}.", f"decoder.layers.{j}."
                s[me + "input_layernorm.weight"] = hf[pre + "input_layernorm.weight"]
                s[me + "self_attention.linear_qkv.weight"] = qkv("weight")
                if pre + "self_attn.q_proj.bias" in hf:
                    s[me + "self_attention.linear_qkv.bias"] = qkv("bias")
                if pre + "self_attn.q_norm.weight" in hf:
                    s[me + "self_attention.q_layernorm.weight"] = hf[
                        pre + "self_attn.q_norm.weight"
                    ]
                    s[me + "self_attention.k_layernorm.weight"] = hf[
                        pre + "self_attn.k_norm.weight"
                    ]
                s[me + "self_attention.linear_proj.weight"] = hf[
                    pre + "self_attn.o_proj.weight"
                ].chunk(tp, 1)[t]
                s[me + "pre_mlp_layernorm.weight"] = hf[pre + "post_attention_layernorm.weight"]
                s[me + "mlp.linear_fc1.weight"] = torch.cat(
                    [
                        hf[pre + "mlp.gate_proj.weight"].chunk(tp, 0)[t],
                        hf[pre + "mlp.up_proj.weight"].chunk(tp, 0)[t],
                    ]
                )
                s[me + "mlp.linear_fc2.weight"] = hf[pre + "mlp.down_proj.weight"].chunk(tp, 1)[t]
            if p == pp - 1:
                s["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
                if not (tied and pp == 1):
                    s["output_layer.weight"] = out_w.chunk(tp, 0)[t]
            shards[(t, p)] = s
    return shards


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (2, 1)])
def test_shards_hold_megatrons_layout_built_by_hand(tmp_path, arch, tp, pp):
    """Every shard file equals an independent construction of Megatron's layout from the HF
    tensors (names, shapes, values, padding rows zero, the stored dtype), so a slip in the
    shared weight table (which also loads and exports) cannot hide behind itself."""
    from safetensors.torch import load_file

    src = tiny(tmp_path / "src", arch, "bfloat16")
    ck = hf_to_megatron(src, tmp_path / "ck", tp=tp, pp=pp, progress=False)
    cfg = json.loads((src / "config.json").read_text())
    padded_vocab = 128 * tp * -(-cfg["vocab_size"] // (128 * tp))
    expected = megatron_shards_by_hand(hf_tensors(src), cfg, tp, pp, padded_vocab)
    for (t, p), want in expected.items():
        got = load_file(str(ck / "megatron" / f"tp{t:02d}_pp{p:02d}.safetensors"))
        assert sorted(got) == sorted(want), (t, p)
        for name, tensor in got.items():
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, want[name]), (t, p, name)


def test_dtype_cast_and_sharded_output(tmp_path):
    """--dtype on the way in and out; a small --max-shard-size gives an index that
    transformers loads; config.json states the dtype written."""
    src = tiny(tmp_path / "src", "llama")
    ck = hf_to_megatron(src, tmp_path / "ck", tp=2, pp=1, dtype="bfloat16", progress=False)
    assert json.loads((ck / "config.json").read_text())["dtype"] == "bfloat16"
    back = megatron_to_hf(
        ck, tmp_path / "back", dtype="float32", max_shard_bytes=40_000, progress=False
    )
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
        ck = hf_to_megatron(
            "smollm2-135m-instruct", tmp_path / f"ck{tp}{pp}", tp=tp, pp=pp, progress=False
        )
        back = megatron_to_hf(ck, tmp_path / f"back{tp}{pp}", progress=False)
        assert_same_tensors(src, back)
        assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
        assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
