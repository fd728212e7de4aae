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


def test_a_file_appearing_two_levels_deep_in_the_output_is_kept(tmp_path):
    """Issue 32 (a mutant that survived): a snapshot of the output's top level only (names,
    sizes, times) misses a file added two levels down, whose parent's parent does not
    change, and the publish deleted it. The snapshot covers the whole tree."""
    dest = tmp_path / "out"
    (dest / "sub" / "inner").mkdir(parents=True)
    (dest / "sub" / "inner" / "old.txt").write_text("old")
    with pytest.raises(files.FolderChanged, match=r"new: sub/inner/notes.txt"):
        with atomic_folder(dest) as tmp:
            (tmp / "model.bin").write_text("finished")
            (dest / "sub" / "inner" / "notes.txt").write_text("a user's file")
    assert (dest / "sub" / "inner" / "notes.txt").read_text() == "a user's file"


def test_a_symlinked_output_is_written_through_the_link_and_nothing_is_left(tmp_path, caplog):
    """Issue 32: ``--out <a link to a folder> --overwrite`` renamed the link aside, never
    removed its ``.out.old-*`` copy, and the next write called it a write "killed
    midway". The folder the link names is replaced; the link stays."""
    target = tmp_path / "real"
    target.mkdir()
    (target / "old.bin").write_text("old")
    link = tmp_path / "out"
    link.symlink_to(target)
    for n in range(2):
        with caplog.at_level("WARNING", logger="nemo_d3s.files"):
            with atomic_folder(link) as tmp:
                (tmp / "model.bin").write_text(f"new {n}")
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert _entries(target) == ["model.bin"] and (link / "model.bin").read_text() == f"new {n}"
        assert sorted(_entries(tmp_path)) == ["out", "real"]  # no hidden .out.old-* / .lock
    assert "killed midway" not in caplog.text


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


# ---------------------------------------------------------------- single files
def test_atomic_write_text_flushes_the_file_and_its_folder_and_replaces_it(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def tracking_fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", tracking_fsync)
    target = tmp_path / "summary.json"
    target.write_text("old")
    assert files.atomic_write_text(target, '{"steps": 3}') == target
    assert target.read_text() == '{"steps": 3}'
    assert synced[0].startswith(".summary.json.tmp-") and synced[-1] == tmp_path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_failed_single_file_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("seed: 1\n")
    with pytest.raises(TypeError):
        files.atomic_write_text(target, None)  # not text: fails while writing
    assert target.read_text() == "seed: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_the_run_records_are_written_through_atomic_write_text(tmp_path, monkeypatch):
    from nemo_d3s.trainer import records
    from nemo_d3s.trainer.checkpoint import TrainerState

    written = []
    real = records.atomic_write_text
    monkeypatch.setattr(
        records, "atomic_write_text", lambda p, text: written.append(p.name) or real(p, text)
    )
    records.summary(TrainerState(step=2), tmp_path, task=None)
    records.write_interrupted_marker(tmp_path, {"step": 2})
    assert written == ["summary.json", records.INTERRUPTED_MARKER]


@pytest.mark.parametrize(
    "error, failed_write",
    [
        (OSError(28, "No space left on device"), True),
        (RuntimeError("[enforce fail at inline_container.cc] PytorchStreamWriter failed"), True),
        # megatron-core 0.19.2's DCP writer keeps only the text of its worker's OSError
        # (dist_checkpointing/strategies/filesystem_async.py:330)
        (
            RuntimeError(
                "Worker failure: An error is caught while starting worker 0, error: "
                "<class 'OSError'>"
            ),
            True,
        ),
        (RuntimeError("Worker failure: An error is caught ..., error: <class 'KeyError'>"), False),
        (ValueError("No space left"), False),  # not an error type a write raises
    ],
)
def test_which_errors_are_failed_writes(error, failed_write):
    assert files_staging.looks_like_write_failure(error) is failed_write
