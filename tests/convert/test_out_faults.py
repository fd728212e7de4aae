"""Issue 25: the converter's output folder and the files it reads, under the faults a user
meets: files that appear in ``--out`` while it runs (items 1), two conversions into one
``--out`` (2), a flipped bit in a converted checkpoint (4), a truncated safetensors file
(5), a conversion killed midway (7), ``--out`` inside its input (7)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import assert_same_tensors  # noqa: E402

from nemo_d3s.convert import hf_to_megatron, megatron_to_hf, verify  # noqa: E402
from nemo_d3s.convert.__main__ import main  # noqa: E402
from nemo_d3s.errors import ConfigError  # noqa: E402
from nemo_d3s.files import FolderChanged  # noqa: E402
from nemo_d3s.formats.safetensors_stream import StreamingSafetensors  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _during_first_write(monkeypatch, action):
    """Run ``action()`` once, when the conversion writes its first tensor."""
    real = StreamingSafetensors.write
    state = {"done": False}

    def write(self, name, t):
        if not state["done"]:
            state["done"] = True
            action()
        return real(self, name, t)

    monkeypatch.setattr(StreamingSafetensors, "write", write)


def test_files_that_appear_in_out_while_it_converts_are_not_deleted(
    tmp_path, made, monkeypatch, capsys
):
    src, ck = made
    out = tmp_path / "out"
    out.mkdir()  # empty: allowed without --overwrite
    _during_first_write(monkeypatch, lambda: (out / "notes.txt").write_text("the user's notes"))
    with pytest.raises(FolderChanged) as e:
        megatron_to_hf(ck, out, progress=False)
    assert (
        os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "the user's notes"
    )
    kept = e.value.kept
    assert kept.name.startswith("out.unpublished-") and str(kept) in str(e.value)
    assert_same_tensors(
        kept, megatron_to_hf(ck, tmp_path / "clean", progress=False)
    )  # the finished output
    # the CLI: one error line naming where the output is; even --overwrite does not delete the new
    # file
    _during_first_write(monkeypatch, lambda: (out / "more.txt").write_text("more"))
    assert (
        main(["megatron-to-hf", "--ckpt", str(ck), "--out", str(out), "--overwrite", "--quiet"])
        == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert "changed while it was being written (new: more.txt)" in err and "unpublished-" in err
    assert sorted(os.listdir(out)) == ["more.txt", "notes.txt"]


def test_a_second_conversion_into_the_same_out_is_refused(tmp_path, made, monkeypatch):
    src, ck = made
    out = tmp_path / "out"
    seen = {}

    def second():
        with pytest.raises(
            ConfigError, match=r"is being written by another conversion \(pid \d+ on "
        ) as e:
            megatron_to_hf(ck, out, progress=False)
        seen["error"] = str(e.value)

    _during_first_write(monkeypatch, second)
    megatron_to_hf(ck, out, progress=False)  # the first one finishes and publishes
    assert "error" in seen
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no lock file, no staging folder left
    assert (out / "model.safetensors").is_file()


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a tensor: the header still parses
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_converted_shard_is_caught(tmp_path, made, capsys):
    src, ck = made
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    assert (bad / "checksums.json").is_file()
    _flip_a_bit(bad / "megatron" / "tp01_pp00.safetensors")
    msg = (
        "is not a complete checkpoint: megatron/tp01_pp00.safetensors does not match its "
        "SHA-256 checksum"
    )
    with pytest.raises(ConfigError, match=msg):
        megatron_to_hf(bad, tmp_path / "hf", progress=False)
    with pytest.raises(ConfigError, match=msg):
        verify(src, bad)
    assert sorted(os.listdir(tmp_path)) == ["bad"]
    assert (
        main(["megatron-to-hf", "--ckpt", str(bad), "--out", str(tmp_path / "hf"), "--quiet"]) == 1
    )
    err = capsys.readouterr().err
    assert msg in err and "--no-verify-checksums" in err and len(err.splitlines()) == 1
    # the documented switch converts it anyway
    assert (
        main(
            [
                "megatron-to-hf",
                "--ckpt",
                str(bad),
                "--out",
                str(tmp_path / "hf"),
                "--quiet",
                "--no-verify-checksums",
            ]
        )
        == 0
    )


def test_a_truncated_safetensors_file_is_one_line_naming_it(tmp_path, made, capsys):
    src, ck = made
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # an interrupted download
    want = f"{str(weights)!r} is truncated: its tensors need"
    with pytest.raises(ConfigError, match=want):
        hf_to_megatron(hf, tmp_path / "ck", progress=False)
    with pytest.raises(ConfigError, match=want):
        verify(hf, ck)
    assert main(["hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "ck"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and want in err and len(err.splitlines()) == 1
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ConfigError, match="is not a safetensors file: garbled header"):
        hf_to_megatron(hf, tmp_path / "ck", progress=False)
    # a converted shard cut short (its checksums not checked, so the reader meets it)
    cut = tmp_path / "cut"
    shutil.copytree(ck, cut)
    shard = cut / "megatron" / "tp00_pp00.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(ConfigError, match=f"{str(shard)!r} is truncated"):
        megatron_to_hf(cut, tmp_path / "out", progress=False, verify_checksums=False)


def test_hf_backend_names_a_truncated_weights_file(tmp_path, made):
    from nemo_d3s.backends.hf.config import HFBackendConfig
    from nemo_d3s.backends.hf.loading import load_model_and_tokenizer

    src, _ = made
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"{str(hf / 'model.safetensors')!r} is truncated"):
        load_model_and_tokenizer(HFBackendConfig(model=str(hf), device="cpu"))


def test_a_conversion_killed_midway_leaves_a_staging_folder_the_next_one_removes(
    tmp_path, made, caplog
):
    src, ck = made
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import sys, time
        from nemo_d3s.convert import megatron_to_hf
        from nemo_d3s.formats.safetensors_stream import StreamingSafetensors
        real = StreamingSafetensors.write
        def write(self, name, t):
            real(self, name, t)
            print("writing", flush=True)
            time.sleep(120)
        StreamingSafetensors.write = write
        megatron_to_hf({str(ck)!r}, {str(out)!r}, progress=False)
    """)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(left) == 1 and any(left[0].iterdir())  # what kill -9 leaves behind
    assert f"-{proc.pid}-" in left[0].name
    with caplog.at_level("WARNING", logger="nemo_d3s.files"):
        megatron_to_hf(ck, out, progress=False)
    assert not left[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert str(left[0]) in caplog.text and f"pid {proc.pid}" in caplog.text


def test_out_inside_the_input_is_refused(tmp_path, made):
    src, ck = made
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    with pytest.raises(ConfigError, match="is inside the source"):
        megatron_to_hf(copy, copy / "hf", progress=False)
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    with pytest.raises(ConfigError, match="is inside the source"):
        hf_to_megatron(hf, hf / "converted" / "tp1", progress=False)
    assert sorted(os.listdir(copy)) == sorted(os.listdir(ck)) and sorted(os.listdir(hf)) == sorted(
        os.listdir(src)
    )


def test_a_checkpoint_without_checksums_json_is_refused_like_the_trainer_refuses_it(
    tmp_path, made, capsys
):
    """Issue 32: a converted checkpoint with checksums.json deleted converted (and trained)
    without a notice while the trainer called the same folder unusable. One policy now
    (formats.checksums.missing_checksums): refused, naming the file and the switch."""
    src, ck = made
    bare = tmp_path / "bare"
    shutil.copytree(ck, bare)
    (bare / "checksums.json").unlink()
    msg = "has no checksums.json, which this kind of checkpoint is always written with"
    with pytest.raises(ConfigError, match=msg):
        megatron_to_hf(bare, tmp_path / "hf", progress=False)
    with pytest.raises(ConfigError, match=msg):
        verify(src, bare)
    assert main(["megatron-to-hf", "--ckpt", str(bare), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert msg in err and "--no-verify-checksums" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "hf").exists()
    argv = ["megatron-to-hf", "--ckpt", str(bare), "--out", str(tmp_path / "hf")]
    assert main([*argv, "--quiet", "--no-verify-checksums"]) == 0
