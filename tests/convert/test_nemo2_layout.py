"""The NeMo 2 layout without nemo-toolkit: checkpoints written by megatron-core's
``dist_checkpointing`` (the library NeMo saves with) under NeMo's key names, with a
``context/`` as NeMo's importer writes it (``_models.nemo_context``). The same code is
checked against nemo-toolkit itself in ``test_nemo_toolkit.py`` where NeMo is installed.

- Megatron (TP2 x PP2 / TP1) -> NeMo 2 -> HF is bit-exact (Llama fp32, Qwen2 bf16 tied);
  the weights are NeMo's names, layer-stacked, one chunk per layer, with the
  ``_extra_state`` objects NeMo's modules load; ``verify`` agrees;
- a NeMo 2 checkpoint written at TP2 x PP2 by megatron-core's own ``sharded_state_dict`` +
  ``dist_checkpointing.save`` on 4 ranks (what NeMo does at that layout) reads back bit-exactly;
- NeMo 2 as a training start: ``hf_to_megatron`` from it gives the shards it gives from the
  HF folder, and the Megatron backend starting there, or from the NeMo 2 folder itself
  (``model.name=<NeMo 2 folder>``, TP2), scores as transformers does; the latter's HF export
  holds the source tensors;
- bad input: a pickle in ``.metadata`` that would run code is refused (and not run), an
  unsupported model, shapes that disagree with ``model.yaml``, no tokenizer, a context of
  another model; nothing is written.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import assert_same_tensors, hf_tensors, nemo_context, tiny  # noqa: E402
from _launch import run_ranks  # noqa: E402

from nemo_d3s.config import ConfigError  # noqa: E402
from nemo_d3s.convert import hf_to_megatron, megatron_to_hf, megatron_to_nemo, verify  # noqa: E402
from nemo_d3s.formats.nemo2 import DcpIndex  # noqa: E402
from _limits import WAIT_S  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{arch: (HF source, NeMo 2 checkpoint written by nemo_d3s)}."""
    root = tmp_path_factory.mktemp("nemo2")
    out = {}
    for arch, dtype, (tp, pp) in (
        ("llama", "float32", (2, 2)),
        ("qwen2", "bfloat16", (1, 1)),
        ("qwen3", "bfloat16", (2, 2)),
    ):
        src = tiny(root / f"{arch}_hf", arch, dtype)
        ck = hf_to_megatron(src, root / f"{arch}_ck", tp=tp, pp=pp, progress=False)
        ctx = nemo_context(src, root / f"{arch}_ctx")
        out[arch] = (
            src,
            megatron_to_nemo(ck, root / f"{arch}_nemo", nemo_context=ctx, progress=False),
        )
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_megatron_to_nemo_to_hf_is_bit_exact(arch, written, tmp_path):
    src, nemo = written[arch]
    assert sorted(os.listdir(nemo)) == ["checksums.json", "context", "weights"]
    assert (
        json.loads((nemo / "weights" / "metadata.json").read_text())["sharded_backend"]
        == "torch_dist"
    )
    index = DcpIndex(nemo / "weights")
    L, names = 4, set(index.tensors)
    qkv = "module.decoder.layers.self_attention.linear_qkv.weight"
    d = 16 if arch == "qwen3" else 8  # Qwen3's head_dim is set apart from hidden / heads
    assert index.tensors[qkv][0] == (L, (4 + 2 * 2) * d, 32)  # layers stacked, fused q/k/v
    qk_norm = "module.decoder.layers.self_attention.q_layernorm.weight"
    assert (qk_norm in names) == (arch == "qwen3")
    assert len(index.chunks[qkv]) == L  # one chunk per layer
    assert (
        "module.decoder.layers.self_attention.linear_qkv.layer_norm_weight" in names
    )  # NeMo's (TE) names
    assert ("module.output_layer.weight" in names) == (arch == "llama")
    assert index.tensors["module.embedding.word_embeddings.weight"][0] == (
        300,
        32,
    )  # NeMo's divisor 4
    raw = (nemo / "weights" / ".metadata").read_bytes()
    assert b"module.decoder.layers.mlp.linear_fc2._extra_state/shard_3_4" in raw
    qk_state = b"module.decoder.layers.self_attention.k_layernorm._extra_state/shard_3_4"
    assert (qk_state in raw) == (arch == "qwen3")  # TE's RMSNorm carries one
    back = megatron_to_hf(nemo, tmp_path / "back", progress=False)
    assert_same_tensors(src, back)
    cfg, want = (
        json.loads((back / "config.json").read_text()),
        json.loads((src / "config.json").read_text()),
    )
    for key in (
        "architectures",
        "vocab_size",
        "hidden_size",
        "num_key_value_heads",
        "tie_word_embeddings",
    ):
        assert cfg[key] == want[key], key
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(back))
    res = verify(src, nemo)
    assert res.ok and res.max_abs_err == 0.0 and res.layout == "NeMo 2"


def _rank_scores(rank, folder):
    from nemo_d3s.backends.base import TokenBatch
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    pol = MegatronBackend(MegatronBackendConfig(model=folder, device="cpu"))
    ids = torch.tensor([[5, 70, 71, 72, 101, 33, 9, 250]])
    attn = torch.ones_like(ids, dtype=torch.bool)
    return pol.score(TokenBatch(ids, attn, attn), with_entropy=False).logprobs, ids


@pytest.mark.slow  # a whole program run: the slow tier (docs/ci.md)
def test_nemo2_as_a_training_start(written, tmp_path):
    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    src, nemo = written["qwen2"]
    from_nemo = hf_to_megatron(nemo, tmp_path / "from_nemo", tp=2, progress=False)
    from_hf = hf_to_megatron(src, tmp_path / "from_hf", tp=2, progress=False)
    for f in sorted(os.listdir(from_hf / "megatron")):
        if f.endswith(".safetensors"):
            assert_same_tensors_file(from_hf / "megatron" / f, from_nemo / "megatron" / f)
    lp, ids = run_ranks(_rank_scores, 1, str(from_nemo), tp=1, pp=1, timeout=WAIT_S)[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    want = align_to_tokens(entropy_and_logprobs(logits[:, :-1], ids[:, 1:])[1])
    assert float((lp - want).abs().max()) <= 1e-4
    # the model a NeMo 2 folder describes (what the dry run and the backend plan with)
    from nemo_d3s.formats.spec import ModelSpec

    spec_nemo, spec_hf = ModelSpec.from_folder(nemo).to_dict(), ModelSpec.from_folder(src).to_dict()
    assert {k: v for k, v in spec_nemo.items() if k != "torch_dtype"} == {
        k: v for k, v in spec_hf.items() if k != "torch_dtype"
    }
    # model.name=<the NeMo 2 folder> itself, at TP2 on 2 ranks: the same scores; its HF
    # export holds the source tensors and loads in transformers
    direct = run_ranks(
        _rank_scores_and_export, 2, str(nemo), str(tmp_path / "export"), tp=2, pp=1, timeout=WAIT_S
    )
    for lp2, side_removed in direct:
        assert float((lp2 - want).abs().max()) <= 1e-4
        assert side_removed
    exported, source = hf_tensors(tmp_path / "export"), hf_tensors(src)
    assert sorted(exported) == sorted(source)
    for k, t in source.items():
        assert torch.equal(exported[k], t.float()), k
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).config.hidden_size == 32


def _rank_scores_and_export(rank, folder, export):
    """Scores of a backend started from ``folder`` at TP2, its HF export, and whether its
    private config/tokenizer folder is gone once the backend is."""
    import gc

    from nemo_d3s.backends.base import TokenBatch
    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig

    pol = MegatronBackend(
        MegatronBackendConfig(model=folder, device="cpu", tensor_model_parallel_size=2)
    )
    side = pol.hf_source_dir()
    assert side != folder and os.path.isfile(os.path.join(side, "tokenizer_config.json"))
    ids = torch.tensor([[5, 70, 71, 72, 101, 33, 9, 250]])
    attn = torch.ones_like(ids, dtype=torch.bool)
    lp = pol.score(TokenBatch(ids, attn, attn), with_entropy=False).logprobs
    pol.save_pretrained(export)
    del pol
    gc.collect()
    return lp, not os.path.exists(side)


def _rank_save_sharded_state_dict(rank, folder, weights):
    """What NeMo's strategy does when it saves a model trained at TP x PP: megatron-core's own
    ``sharded_state_dict`` of every stage (prefix "module.", layers stacked by global index,
    the gated fc1 stored by its swiglu factory as [gate; up] chunks per TP rank) through
    ``dist_checkpointing.save`` on all ranks."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron.backend import MegatronBackend
    from nemo_d3s.backends.megatron.config import MegatronBackendConfig
    from nemo_d3s.backends.megatron.nemo2_writer import _TorchOnCpu

    pol = MegatronBackend(
        MegatronBackendConfig(
            model=folder,
            device="cpu",
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        )
    )
    with _TorchOnCpu():
        dist_checkpointing.save(pol.model.sharded_state_dict(prefix="module."), weights)


@pytest.mark.slow  # a multi-rank equality run of 20-60 s: the slow tier (docs/ci.md)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_nemo2_written_at_tp2_pp2_by_megatron_core(arch, tmp_path):
    """A NeMo 2 checkpoint whose weights megatron-core wrote from 4 TP2 x PP2 ranks (what a
    NeMo run at that layout writes; NeMo's HF importer only writes TP1) reads back bit-exactly
    and starts the backend at TP1, scoring as transformers does."""
    from transformers import AutoModelForCausalLM

    from nemo_d3s.core.entropy import align_to_tokens, entropy_and_logprobs

    src = tiny(tmp_path / "hf", arch, "float32")
    nemo = tmp_path / "nemo"
    (nemo / "weights").mkdir(parents=True)
    run_ranks(
        _rank_save_sharded_state_dict,
        4,
        str(src),
        str(nemo / "weights"),
        tp=2,
        pp=2,
        timeout=WAIT_S,
    )
    shutil.copytree(nemo_context(src, tmp_path / "ctx") / "context", nemo / "context")
    index = DcpIndex(nemo / "weights")
    fc1 = "module.decoder.layers.mlp.linear_fc1.weight"
    assert len(index.chunks[fc1]) == 4 * 2 * 2  # per layer: gate and up halves of both TP ranks
    assert_same_tensors(src, megatron_to_hf(nemo, tmp_path / "back", progress=False))
    lp, ids = run_ranks(_rank_scores, 1, str(nemo), tp=1, pp=1, timeout=WAIT_S)[0]
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        want = align_to_tokens(
            entropy_and_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[1]
        )
    assert float((lp - want).abs().max()) <= 1e-4


def assert_same_tensors_file(a, b):
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), (a.name, k)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ["NEMO_D3S_PWNED"],))


def _refused(parent, match, fn, *args, **kw):
    before = sorted(os.listdir(parent))
    with pytest.raises(ConfigError, match=match):
        fn(*args, **kw)
    assert sorted(os.listdir(parent)) == before


def _bare_copy(src, dst):
    """A copy to damage, without checksums.json (as NeMo itself writes them): the checks under
    test are the ones past the checksums (``test_a_flipped_bit_in_a_nemo2_output_is_caught``)."""
    shutil.copytree(src, dst)
    (dst / "checksums.json").unlink()
    return dst


def test_a_flipped_bit_in_a_nemo2_output_is_caught(written, tmp_path):
    """Issue 25 item 4: megatron-to-nemo's output carries checksums.json, and every command
    that reads it (as a source of megatron-to-hf, hf-to-megatron, verify) checks it first."""
    src, nemo = written["llama"]
    bad = shutil.copytree(nemo, tmp_path / "bad")
    chunk = sorted((bad / "weights").glob("*.distcp"))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    msg = f"is not a complete checkpoint: weights/{chunk.name} does not match its SHA-256 checksum"
    _refused(tmp_path, msg, megatron_to_hf, bad, tmp_path / "out", progress=False)
    _refused(tmp_path, msg, hf_to_megatron, bad, tmp_path / "out", progress=False)
    _refused(tmp_path, msg, verify, src, bad)
    megatron_to_hf(
        bad, tmp_path / "out", progress=False, verify_checksums=False
    )  # the documented switch


def test_a_fine_tuned_seq_length_is_not_another_model(written, tmp_path):
    """NeMo 2 records no max_position_embeddings: seq_length (set by fine-tuning recipes, 2048
    by default) stands in for it. A checkpoint fine-tuned at seq_length 64 is the HF model
    (max_position_embeddings 256) for --hf-config, verify and --nemo-context, and its export
    with --hf-config keeps the HF config's 256; without, the config says 64."""
    import yaml

    src, nemo = written["llama"]
    tuned = _bare_copy(nemo, tmp_path / "tuned")
    doc = yaml.safe_load((tuned / "context" / "model.yaml").read_text())
    doc["config"]["seq_length"] = 64
    (tuned / "context" / "model.yaml").write_text(yaml.safe_dump(doc))
    out = megatron_to_hf(tuned, tmp_path / "with", hf_config=src, progress=False)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256
    out = megatron_to_hf(tuned, tmp_path / "without", progress=False)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 64
    assert verify(src, tuned).ok
    megatron_to_nemo(nemo, tmp_path / "ctx", nemo_context=tuned, progress=False)
    doc["config"]["ffn_hidden_size"] = 64  # another model is still one
    (tuned / "context" / "model.yaml").write_text(yaml.safe_dump(doc))
    _refused(
        tmp_path,
        "different models: ffn_hidden_size=48 vs 64",
        megatron_to_nemo,
        nemo,
        tmp_path / "out",
        nemo_context=tuned,
        progress=False,
    )


def test_bad_nemo2_input(written, tmp_path, monkeypatch):
    import yaml

    src, nemo = written["llama"]
    # a .metadata that would run a command when unpickled
    evil = _bare_copy(nemo, tmp_path / "evil")
    flag = tmp_path / "pwned"
    monkeypatch.setenv("NEMO_D3S_PWNED", str(flag))
    (evil / "weights" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    _refused(
        tmp_path,
        r"\.metadata.*refusing to unpickle (posix|os)\.system",
        megatron_to_hf,
        evil,
        tmp_path / "out",
        progress=False,
    )
    assert not flag.exists()
    # a model the table does not know
    moe = _bare_copy(nemo, tmp_path / "moe")
    doc = yaml.safe_load((moe / "context" / "model.yaml").read_text())
    doc["config"]["_target_"] = "nemo.collections.llm.gpt.model.mixtral.MixtralConfig8x7B"
    (moe / "context" / "model.yaml").write_text(yaml.safe_dump(doc))
    _refused(
        tmp_path,
        "model.yaml.*MixtralConfig8x7B' is not supported",
        megatron_to_hf,
        moe,
        tmp_path / "out",
        progress=False,
    )
    # shapes that disagree with model.yaml
    wide = _bare_copy(nemo, tmp_path / "wide")
    doc = yaml.safe_load((wide / "context" / "model.yaml").read_text())
    doc["config"]["ffn_hidden_size"] = 64
    (wide / "context" / "model.yaml").write_text(yaml.safe_dump(doc))
    _refused(
        tmp_path,
        r"\.metadata.*'module.decoder.layers.mlp.linear_fc1.weight' has shape \[4, 96, 32\], "
        r"context/model.yaml gives \[4, 128, 32\]",
        megatron_to_hf,
        wide,
        tmp_path / "out",
        progress=False,
    )
    # no tokenizer in the context
    notok = _bare_copy(nemo, tmp_path / "notok")
    shutil.rmtree(notok / "context" / "nemo_tokenizer")
    _refused(
        tmp_path,
        "nemo_tokenizer.*has no tokenizer",
        megatron_to_hf,
        notok,
        tmp_path / "out",
        progress=False,
    )
    # a context of another model for the NeMo output
    qwen_src, qwen_nemo = written["qwen2"]
    _refused(
        tmp_path,
        "are different models: architecture=",
        megatron_to_nemo,
        nemo,
        tmp_path / "out",
        nemo_context=qwen_nemo,
        progress=False,
    )
    _refused(
        tmp_path,
        "not a NeMo 2 checkpoint .no context/model.yaml",
        megatron_to_nemo,
        nemo,
        tmp_path / "out",
        nemo_context=src,
        progress=False,
    )
    # weights whose chunks are gone
    cut = _bare_copy(nemo, tmp_path / "cut")
    for f in (cut / "weights").glob("*.distcp"):
        f.write_bytes(b"")
    _refused(
        tmp_path,
        "distcp.*chunk of .* is unreadable",
        megatron_to_hf,
        cut,
        tmp_path / "out",
        progress=False,
    )
    assert hf_tensors(src)  # the source is untouched
