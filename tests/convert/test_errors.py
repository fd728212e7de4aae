"""Bad input for every command: each a ConfigError (exit code 1 from the CLI) naming the
file or tensor, raised before anything is written, and no output folder (nor temporary
sibling) left behind; an interrupt mid-write leaves nothing either."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import tiny  # noqa: E402

from nemo_d3s.config import ConfigError  # noqa: E402
from nemo_d3s.errors import RunError  # noqa: E402
from nemo_d3s.convert import hf_to_megatron, megatron_to_hf, verify  # noqa: E402
from nemo_d3s.formats.safetensors_stream import StreamingSafetensors  # noqa: E402
from nemo_d3s.convert.__main__ import main  # noqa: E402


def _nothing_written(parent, keep):
    assert sorted(os.listdir(parent)) == sorted(keep), os.listdir(parent)


@pytest.fixture(autouse=True)
def _older_folders_unchecked(monkeypatch):
    """The copies below are damaged without checksums.json (as an older version wrote
    them), to reach the checks a damaged file meets past the checksums; a folder without
    checksums.json is refused by default (formats.checksums.missing_checksums, tested in
    test_out_faults.py), so that policy is switched off here."""
    monkeypatch.setattr("nemo_d3s.formats.checksums.missing_checksums", lambda *a, **k: None)


def _copy(src, dst):
    """A copy to damage, without checksums.json (as an older version wrote them): the
    checks under test are the ones a damaged file meets past the checksums
    (``test_a_flipped_bit_in_a_converted_shard_is_caught`` tests those)."""
    shutil.copytree(src, dst)
    (Path(dst) / "checksums.json").unlink(missing_ok=True)
    return dst


def _refused(tmp_path, match, fn, *args, **kw):
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match=match):
        fn(*args, **kw)
    _nothing_written(tmp_path, before)


def test_not_a_checkpoint(tmp_path, made):
    src, ck = made
    (tmp_path / "empty").mkdir()
    _refused(
        tmp_path,
        "is not a Megatron checkpoint: no megatron/layout.json",
        megatron_to_hf,
        tmp_path / "empty",
        tmp_path / "out",
        progress=False,
    )
    _refused(
        tmp_path,
        "Hugging Face model folder .use hf-to-megatron",
        megatron_to_hf,
        src,
        tmp_path / "out",
        progress=False,
    )
    _refused(
        tmp_path,
        "no such folder",
        megatron_to_hf,
        tmp_path / "nope",
        tmp_path / "out",
        progress=False,
    )
    runs = tmp_path / "run" / "checkpoints"
    (runs / "step_000002").mkdir(parents=True)
    (runs / "step_000004").mkdir()
    _refused(tmp_path, "step_000004", megatron_to_hf, runs, tmp_path / "out", progress=False)
    # garbled layout.json
    bad = _copy(ck, tmp_path / "bad")
    (bad / "megatron" / "layout.json").write_text("{not json")
    _refused(
        tmp_path,
        "layout.json.*not a nemo_d3s Megatron checkpoint layout",
        megatron_to_hf,
        bad,
        tmp_path / "out",
        progress=False,
    )
    # a shard that is not safetensors (e.g. a pickle)
    bad2 = _copy(ck, tmp_path / "bad2")
    (bad2 / "megatron" / "tp01_pp00.safetensors").write_bytes(b"\x80\x04\x95garbage" * 10)
    _refused(
        tmp_path,
        "tp01_pp00.safetensors.*is not a safetensors file",
        megatron_to_hf,
        bad2,
        tmp_path / "out",
        progress=False,
    )
    # a missing shard
    bad3 = _copy(ck, tmp_path / "bad3")
    os.remove(bad3 / "megatron" / "tp01_pp01.safetensors")
    _refused(
        tmp_path,
        "tp01_pp01.safetensors.*is missing",
        megatron_to_hf,
        bad3,
        tmp_path / "out",
        progress=False,
    )


def test_unknown_architecture(tmp_path, made):
    src, ck = made
    other = _copy(src, tmp_path / "gpt2")
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    _refused(
        tmp_path,
        "GPT2LMHeadModel.*not supported",
        hf_to_megatron,
        other,
        tmp_path / "out",
        progress=False,
    )
    _refused(
        tmp_path,
        "GPT2LMHeadModel.*not supported",
        megatron_to_hf,
        ck,
        tmp_path / "out",
        hf_config=other,
        progress=False,
    )
    remote = _copy(src, tmp_path / "remote")
    cfg = json.loads((remote / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
    (remote / "config.json").write_text(json.dumps(cfg))
    _refused(tmp_path, "auto_map", hf_to_megatron, remote, tmp_path / "out", progress=False)


def test_shapes_that_disagree_with_config(tmp_path, made):
    from safetensors.torch import load_file, save_file

    src, ck = made
    # HF side: config.json says a wider MLP than the tensors have
    wide = _copy(src, tmp_path / "wide")
    cfg = json.loads((wide / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (wide / "config.json").write_text(json.dumps(cfg))
    _refused(
        tmp_path,
        r"model.layers.0.mlp.gate_proj.weight' has shape \[48, 32\], config.json says \[64, 32\]",
        hf_to_megatron,
        wide,
        tmp_path / "out",
        progress=False,
    )
    # Megatron side, against another config: layout.json records the model
    _refused(
        tmp_path,
        "checkpoint of another model: ffn_hidden_size=48 there, 64 here",
        megatron_to_hf,
        ck,
        tmp_path / "out",
        hf_config=wide,
        progress=False,
    )
    # Megatron side: a shard tensor cut short
    cut = _copy(ck, tmp_path / "cut")
    path = cut / "megatron" / "tp00_pp01.safetensors"
    t = load_file(str(path))
    t["decoder.layers.1.mlp.linear_fc2.weight"] = t["decoder.layers.1.mlp.linear_fc2.weight"][
        :, :10
    ].contiguous()
    save_file(t, str(path))
    _refused(
        tmp_path,
        r"tp00_pp01.safetensors.*decoder.layers.1.mlp.linear_fc2.weight' has shape \[32, 10\], "
        r"config.json gives \[32, 24\]",
        megatron_to_hf,
        cut,
        tmp_path / "out",
        progress=False,
    )
    # a tensor missing from a shard
    del t["decoder.layers.1.mlp.linear_fc2.weight"]
    save_file(t, str(path))
    _refused(
        tmp_path,
        "holds no tensor 'decoder.layers.1.mlp.linear_fc2.weight'",
        megatron_to_hf,
        cut,
        tmp_path / "out",
        progress=False,
    )


def test_missing_tokenizer_and_config(tmp_path, made):
    src, ck = made
    notok = _copy(src, tmp_path / "notok")
    os.remove(notok / "tokenizer.json")
    _refused(
        tmp_path,
        "notok.*has no tokenizer: missing tokenizer.json or tokenizer.model or vocab.json",
        hf_to_megatron,
        notok,
        tmp_path / "out",
        progress=False,
    )
    bare = _copy(ck, tmp_path / "bare")  # a training checkpoint: megatron/ only
    for f in os.listdir(bare):
        if f != "megatron":
            os.remove(bare / f)
    _refused(
        tmp_path,
        "has no config.json .a training checkpoint written before .*: pass --hf-config",
        megatron_to_hf,
        bare,
        tmp_path / "out",
        progress=False,
    )
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    shutil.copyfile(src / "config.json", cfg_only / "config.json")
    _refused(
        tmp_path,
        "cfg_only.*--hf-config.*has no tokenizer: missing tokenizer_config.json",
        megatron_to_hf,
        bare,
        tmp_path / "out",
        hf_config=cfg_only,
        progress=False,
    )
    garbled = _copy(src, tmp_path / "garbled")
    (garbled / "generation_config.json").write_text("{")
    _refused(
        tmp_path,
        "generation_config.json.*not valid JSON",
        hf_to_megatron,
        garbled,
        tmp_path / "out",
        progress=False,
    )
    # with --hf-config the bare checkpoint converts
    megatron_to_hf(bare, tmp_path / "ok", hf_config=src, progress=False)
    assert (tmp_path / "ok" / "tokenizer.json").is_file()


def test_bad_layout_arguments(tmp_path, made):
    src, _ = made
    _refused(
        tmp_path,
        "num_key_value_heads=2 is not divisible by tensor_model_parallel_size=4",
        hf_to_megatron,
        src,
        tmp_path / "out",
        tp=4,
        progress=False,
    )
    _refused(
        tmp_path,
        "num_hidden_layers=4 is not divisible by pipeline_model_parallel_size=3",
        hf_to_megatron,
        src,
        tmp_path / "out",
        pp=3,
        progress=False,
    )
    _refused(
        tmp_path, "--tp=0 must be", hf_to_megatron, src, tmp_path / "out", tp=0, progress=False
    )
    _refused(
        tmp_path,
        "--dtype='int8'",
        hf_to_megatron,
        src,
        tmp_path / "out",
        dtype="int8",
        progress=False,
    )


def test_output_folder_rules(tmp_path, made):
    src, ck = made
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(tmp_path, "is not empty; pass --overwrite", hf_to_megatron, src, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    _refused(
        tmp_path,
        "exists and is not a folder",
        hf_to_megatron,
        src,
        tmp_path / "file",
        progress=False,
    )
    copy = _copy(ck, tmp_path / "ck")
    _refused(
        tmp_path,
        "is .or holds. the source",
        megatron_to_hf,
        copy,
        copy,
        overwrite=True,
        progress=False,
    )
    _refused(
        tmp_path,
        "is .or holds. the source",
        megatron_to_hf,
        copy,
        tmp_path,
        overwrite=True,
        progress=False,
    )
    _refused(
        tmp_path,
        "is .or holds. the source",
        hf_to_megatron,
        src,
        src,
        overwrite=True,
        progress=False,
    )


def test_interrupt_or_error_mid_write_leaves_nothing(tmp_path, made, monkeypatch):
    src, ck = made
    real = StreamingSafetensors.write
    calls = {"n": 0}

    def flaky(self, name, t):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return real(self, name, t)

    monkeypatch.setattr(StreamingSafetensors, "write", flaky)
    with pytest.raises(KeyboardInterrupt):
        megatron_to_hf(ck, tmp_path / "a" / "hf", progress=False)
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        hf_to_megatron(src, tmp_path / "ck", tp=2, progress=False)
    _nothing_written(tmp_path, [])  # not even the parent folder "a" made for the output
    monkeypatch.setattr(StreamingSafetensors, "write", real)
    # a full disk: the write fails with OSError, reported as one RunError line
    monkeypatch.setattr(
        StreamingSafetensors,
        "write",
        lambda self, n, t: (_ for _ in ()).throw(OSError(28, "No space left on device")),
    )
    with pytest.raises(RunError, match=r"could not write --out .*No space left.*nothing was"):
        megatron_to_hf(ck, tmp_path / "hf", progress=False)
    _nothing_written(tmp_path, [])


def test_training_checkpoint_checksums_are_checked(tmp_path, made):
    """A step_XXXXXX folder with checksums.json (what the trainer writes) must match it."""
    from nemo_d3s.files import write_checksums

    src, ck = made
    step = tmp_path / "step_000003"
    shutil.copytree(ck / "megatron", step / "megatron")
    (step / "trainer_state.json").write_text(json.dumps({"step": 3}))
    write_checksums(step)
    shard = step / "megatron" / "tp00_pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(
        tmp_path,
        "not a complete training checkpoint: megatron/tp00_pp00.safetensors does not match its "
        "SHA-256",
        megatron_to_hf,
        step,
        tmp_path / "out",
        hf_config=src,
        progress=False,
    )


def test_cli_errors_and_verify_exit_codes(tmp_path, made, capsys):
    src, ck = made
    assert (
        main(["megatron-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet"])
        == 1
    )
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ")
        and "not a Megatron checkpoint" in err
        and len(err.splitlines()) == 1
    )
    assert main(["verify", "--hf", str(src), "--ckpt", str(ck)]) == 0
    out = capsys.readouterr().out.strip()
    assert (
        out.startswith("OK: max abs logit error 0 ")
        and "TP2 x PP2" in out
        and len(out.splitlines()) == 1
    )
    other = tiny(tmp_path / "other", "llama", seed=1)  # same shapes, other weights
    assert main(["verify", "--hf", str(other), "--ckpt", str(ck)]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith("MISMATCH: max abs logit error ")
    qwen = tiny(tmp_path / "qwen", "qwen2")
    assert main(["verify", "--hf", str(qwen), "--ckpt", str(ck)]) == 1
    assert "are different models: architecture=" in capsys.readouterr().err
    res = verify(other, ck, atol=1e9)
    assert res.ok and res.max_abs_err > 1e-3


def test_help_has_an_example_per_subcommand(capsys):
    for cmd in ("hf-to-megatron", "megatron-to-hf", "verify"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert "example" in text and f"nemo-d3s-convert {cmd}" in text
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert "hf-to-megatron" in capsys.readouterr().out


def test_console_script_is_declared():
    import tomllib

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["nemo-d3s-convert"] == "nemo_d3s.convert.__main__:main"
