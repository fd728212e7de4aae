"""``files.atomic_folder``: the one folder writer (converter, both backends' HF exports, the
default model's GGUF unpacking)."""

from __future__ import annotations

import os
import stat

import pytest

from nemo_d3s import files
from nemo_d3s.files import atomic_folder


def _entries(folder):
    return sorted(p.name for p in folder.iterdir())


def test_publishes_the_staged_folder_with_umask_modes_and_leaves_nothing_else(tmp_path):
    dest = tmp_path / "out"
    with atomic_folder(dest) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-") and _entries(tmp) == []
        (tmp / "a.txt").write_text("new")
        os.chmod(tmp / "a.txt", 0o600)  # what safetensors' temporary files get
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("b")
        assert not dest.exists()  # nothing under the final name until the block is done
    assert _entries(tmp_path) == ["out"]
    assert (dest / "a.txt").read_text() == "new" and (dest / "sub" / "b.txt").read_text() == "b"
    assert stat.S_IMODE((dest / "a.txt").stat().st_mode) == 0o666 & ~files.current_umask()


def test_replaces_an_existing_folder_whole(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with atomic_folder(dest) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _entries(dest) == ["new.txt"]
    assert _entries(tmp_path) == ["out"]  # the old folder, renamed aside, is removed


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failure_leaves_the_old_folder_and_removes_what_it_created(tmp_path, error):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(type(error)):
        with atomic_folder(dest) as tmp:
            (tmp / "half.txt").write_text("half")
            raise error
    assert _entries(tmp_path) == ["out"] and _entries(dest) == ["old.txt"]
    with pytest.raises(type(error)):
        with atomic_folder(tmp_path / "new" / "deeper" / "out") as tmp:
            raise error
    assert _entries(tmp_path) == ["out"]  # the parent folders it made are gone too


def test_a_peer_that_finished_first_is_kept(tmp_path):
    dest = tmp_path / "out"

    def done(folder):
        return (folder / "DONE").is_file()

    with atomic_folder(dest, replace=False, peer_done=done) as tmp:
        (tmp / "mine.txt").write_text("mine")
        dest.mkdir()  # another process publishes while we write
        (dest / "theirs.txt").write_text("theirs")
        (dest / "DONE").write_text("")
    assert _entries(dest) == ["DONE", "theirs.txt"]
    assert _entries(tmp_path) == ["out"]


def test_an_unfinished_folder_in_the_way_is_an_error_not_overwritten(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "notes.txt").write_text("user file")
    with pytest.raises(OSError):
        with atomic_folder(dest, replace=False, peer_done=lambda f: (f / "DONE").is_file()) as tmp:
            (tmp / "mine.txt").write_text("mine")
    assert _entries(dest) == ["notes.txt"] and _entries(tmp_path) == ["out"]


def test_every_file_and_folder_is_flushed_before_the_rename(tmp_path, monkeypatch):
    synced = []
    real_open, real_fsync = os.open, os.fsync
    names = {}

    def tracking_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        names[fd] = os.path.basename(os.fspath(path))
        return fd

    def tracking_fsync(fd):
        synced.append(names.get(fd))
        return real_fsync(fd)

    monkeypatch.setattr(files.os, "open", tracking_open)
    monkeypatch.setattr(files.os, "fsync", tracking_fsync)
    with atomic_folder(tmp_path / "out") as tmp:
        (tmp / "a.bin").write_bytes(b"x")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"y")
        staged = tmp.name
    assert {"a.bin", "b.bin", "sub", staged, tmp_path.name} <= set(synced)
