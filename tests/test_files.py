"""``files.atomic_folder``: the one folder writer (converter, both backends' HF exports, the
default model's GGUF unpacking)."""

from __future__ import annotations

import os
import stat

import pytest

from nemo_d3s import files, files_staging
from nemo_d3s.files import atomic_folder
from nemo_d3s.formats.checksums import verify_checksums


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


# -------------------------------------------------------------- issue 25: locks, changes, leftovers
def test_a_second_writer_of_the_same_folder_is_refused_and_the_lock_file_goes(tmp_path):
    dest = tmp_path / "out"
    with atomic_folder(dest) as tmp:
        (tmp / "first.txt").write_text("first")
        with pytest.raises(files.FolderBusy, match=f"pid {os.getpid()} on "):
            with atomic_folder(dest) as tmp2:
                (tmp2 / "second.txt").write_text("second")
    assert _entries(dest) == ["first.txt"]
    assert _entries(tmp_path) == ["out"]  # no lock file, no staging folder left


def test_files_that_appear_in_the_output_while_it_is_written_are_kept(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(
        files.FolderChanged, match=r"changed while it was being written \(new: notes.txt\)"
    ) as e:
        with atomic_folder(dest) as tmp:
            (tmp / "model.bin").write_text("finished")
            (dest / "notes.txt").write_text("a user's file")  # appears while we write
    assert _entries(dest) == ["notes.txt"] and (dest / "notes.txt").read_text() == "a user's file"
    kept = e.value.kept
    assert (
        kept.parent == tmp_path
        and kept.name.startswith("out.unpublished-")
        and str(kept) in str(e.value)
    )
    assert (kept / "model.bin").read_text() == "finished"
    assert sorted(_entries(tmp_path)) == sorted(["out", kept.name])
    # replaced by another folder, or created where there was none: the same refusal
    with pytest.raises(files.FolderChanged, match="it appeared"):
        with atomic_folder(tmp_path / "new") as tmp:
            (tmp_path / "new").mkdir()


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_staging_folders_of_killed_writers_on_this_host_are_removed_and_reported(tmp_path, caplog):
    dest = tmp_path / "out"
    host = files_staging.host_tag()
    dead, live = _dead_pid(), os.getppid()
    stale = tmp_path / f".out.tmp-{host}-{dead}-0123abcd"
    other_host = tmp_path / f".out.tmp-otherhost-{dead}-0123abcd"
    running = tmp_path / f".out.tmp-{host}-{live}-0123abcd"
    other_out = tmp_path / f".outer.tmp-{host}-{dead}-0123abcd"
    for p in (stale, other_host, running, other_out):
        p.mkdir()
        (p / "shard").write_text("x" * 100)
    with caplog.at_level("WARNING", logger="nemo_d3s.files"):
        with atomic_folder(dest) as tmp:
            (tmp / "a").write_text("a")
    assert not stale.exists()
    assert other_host.exists() and running.exists() and other_out.exists()
    assert (
        str(stale) in caplog.text
        and f"pid {dead}" in caplog.text
        and "killed midway" in caplog.text
    )


def test_a_folder_moved_aside_by_a_killed_writer_is_put_back(tmp_path):
    dest = tmp_path / "out"
    aside = tmp_path / f".out.old-{files_staging.host_tag()}-{_dead_pid()}-0123abcd"
    aside.mkdir()
    (aside / "previous.txt").write_text("the user's previous output")
    with pytest.raises(FileExistsError):
        with atomic_folder(dest, replace=False):
            pass
    assert _entries(dest) == ["previous.txt"] and not aside.exists()


def test_checksums_catch_a_flipped_bit_and_a_truncated_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "c.json").write_text("{}")
    files.write_checksums(tmp_path)
    assert verify_checksums(tmp_path) is None
    data = bytearray((tmp_path / "sub" / "w.bin").read_bytes())
    data[100] ^= 0x01
    (tmp_path / "sub" / "w.bin").write_bytes(bytes(data))
    assert verify_checksums(tmp_path) == "sub/w.bin does not match its SHA-256 checksum (corrupt)"
    (tmp_path / "sub" / "w.bin").write_bytes(bytes(data[:10]))
    assert "sub/w.bin has 10 bytes, 1024 were written" in verify_checksums(tmp_path)


def test_a_kept_output_that_cannot_be_renamed_stays_under_its_staging_name(tmp_path, monkeypatch):
    dest = tmp_path / "out"
    real = os.rename

    def no_rename_to_unpublished(a, b):
        if ".unpublished-" in str(b):
            raise OSError(18, "Invalid cross-device link")
        return real(a, b)

    monkeypatch.setattr(files.os, "rename", no_rename_to_unpublished)
    with pytest.raises(files.FolderChanged) as e:
        with atomic_folder(dest) as tmp:
            (tmp / "model.bin").write_text("finished")
            dest.mkdir()
    assert (
        e.value.kept == tmp and (tmp / "model.bin").read_text() == "finished"
    )  # said where, and there
