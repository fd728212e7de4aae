"""File-system helpers every layer may use (a leaf: no torch, no model code).

- :func:`atomic_folder`: THE way a folder of outputs is written (the converter's outputs,
  both backends' Hugging Face exports, the default model's GGUF unpacking): staged in a
  hidden sibling, flushed to disk, renamed into place; nothing half-written is ever found
  under the final name, and what a failed write created is removed again. It also locks
  the output against a second writer (:class:`FileLock`), refuses to publish over a folder
  that changed while it wrote (the finished output is kept and named), and removes the
  staging folders of writers killed midway on this host (the staging side:
  ``files_staging.py``).
- :func:`atomic_write_text`: the same for one file (``summary.json``, ``config.yaml``,
  ``interrupted.json``, ``dry_run.json``, ``selfcheck.json``, a rewritten ``metrics.jsonl``):
  a hidden sibling, flushed, renamed over the file, the folder flushed.
- :class:`FileLock`: an exclusive ``flock`` (the trainer's run-folder lock is one too).
- :func:`apply_umask`: files written through ``tempfile`` (as safetensors and some
  ``save_pretrained`` paths do) are created mode 0600; an export must be readable by
  colleagues on a shared cluster like every other file of the run, so the modes of a
  written folder are reset to what the process umask gives a normally created file.
- :func:`sha256_file`, :func:`file_digests`, :func:`write_checksums`: the
  ``checksums.json`` (size + SHA-256 per file) that training checkpoints and converted
  checkpoints carry (its check, shared across ranks: ``formats/checksums.py``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from nemo_d3s.files_staging import (  # the flushing helpers are re-exported
    fsync_path,
    atomic_write_text,
    fsync_folder,
    fsync_tree,
    changes,
    host_tag,
    keep_unpublished,
    snapshot,
    staging_folders,
    sweep_stale,
)

__all__ = [
    "CHECKSUMS",
    "FolderBusy",
    "FolderChanged",
    "FolderNotEmpty",
    "FileLock",
    "current_umask",
    "apply_umask",
    "sha256_file",
    "write_checksums",
    "file_digests",
    "fsync_folder",
    "fsync_tree",
    "staging_folders",  # files_staging's, re-exported
    "atomic_folder",
    "atomic_write_text",
    "build_once",
]

log = logging.getLogger("nemo_d3s.files")

CHECKSUMS = "checksums.json"
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


def current_umask() -> int:
    """The process umask (read from /proc where possible: setting it is process-wide)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (a file or a folder, recursively) the modes a plain ``open``/``mkdir``
    would: 0666 & ~umask for files, 0777 & ~umask for folders. Symlinks are left alone."""
    mask = current_umask()
    fmode, dmode = 0o666 & ~mask, 0o777 & ~mask
    root = Path(path)
    if root.is_symlink():
        return
    if root.is_file():
        os.chmod(root, fmode)
        return
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, dmode)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, fmode)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """SHA-256 hex digest of the file at ``path``, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def write_checksums(
    folder: str | os.PathLike, digests: Optional[Dict[str, Dict[str, object]]] = None
) -> Path:
    """Write ``folder/checksums.json``: size and SHA-256 of every file under ``folder``
    (relative POSIX paths; the file itself excluded). Written last, it covers everything.
    ``digests``: entries other processes computed for the files they wrote (as
    :func:`file_digests` returns them); only the files they do not cover are read here."""
    root = Path(folder)
    given = dict(digests or {})
    files = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and not f.is_symlink() and rel != CHECKSUMS:
            files[rel] = given[rel] if rel in given else file_digests(root, [rel])[rel]
    (root / CHECKSUMS).write_text(json.dumps({"format": 1, "files": files}, indent=1))
    return root / CHECKSUMS


def file_digests(folder: str | os.PathLike, rels: List[str]) -> Dict[str, Dict[str, object]]:
    """{rel: {"size", "sha256"}} of the files ``rels`` under ``folder`` (what a process
    records for the files it wrote, right after writing them)."""
    root = Path(folder)
    return {
        rel: {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
        for rel in rels
    }


# ============================================================================ locks
class FolderBusy(OSError):
    """The lock is held by another process; ``holder`` says which (pid, host, since)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(errno.EBUSY, f"{str(path)!r} is locked by {holder}")
        self.path, self.holder = path, holder


class FileLock:
    """Exclusive advisory ``flock`` on the file ``path`` (created when missing), taken
    without waiting: a held lock is :class:`FolderBusy` naming the holder, whose pid, host
    and start time the file holds. The kernel releases it when the holder dies (kill -9
    included). On a filesystem without locks (Lustre without ``-o flock``) the lock is
    skipped with a warning.

    ``remove=True`` unlinks the file on release (a lock file next to an output should not
    outlive the write); the acquirer then checks that the file it locked is still the one
    at ``path`` and retries otherwise, so that two processes never hold locks on two
    different inodes of one name. ``on_acquired``: called once locked, before the holder
    is written (the trainer's fault injection point)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        remove: bool = False,
        on_acquired: Optional[Callable[[], None]] = None,
    ) -> None:
        self.path, self.remove, self.on_acquired = Path(path), remove, on_acquired
        self.fd: Optional[int] = None

    def acquire(self) -> "FileLock":
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = (
                    os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown process"
                )
                os.close(fd)
                raise FolderBusy(self.path, holder) from None
            except OSError as e:
                if e.errno in _NO_LOCKS:
                    log.warning(
                        "cannot lock %s (%s): this filesystem has no file locks, so a "
                        "second writer of the same folder would not be stopped",
                        self.path,
                        e.strerror or e,
                    )
                    self.fd = fd
                    return self
                os.close(fd)
                raise
            if self.remove:  # the holder before us may have unlinked the file we opened
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
            break
        if self.on_acquired is not None:
            self.on_acquired()
        info = (
            f"pid {os.getpid()} on {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        if self.remove:  # unlinked while still held: see the class docstring
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ============================================================================ atomic folders
class FolderNotEmpty(FileExistsError):
    """``atomic_folder(replace=False)``: the output holds files already."""


class FolderChanged(OSError):
    """The output folder changed while it was being written; nothing was replaced and the
    finished output is kept at ``kept``."""

    def __init__(self, dest: Path, what: str, kept: Path) -> None:
        super().__init__(
            errno.EEXIST,
            f"{str(dest)!r} changed while it was being written ({what}); nothing was "
            f"replaced: the finished output is kept at {str(kept)!r}",
        )
        self.dest, self.kept = dest, kept


@contextmanager
def atomic_folder(
    dest: str | os.PathLike,
    *,
    replace: bool = True,
    peer_done: Optional[Callable[[Path], bool]] = None,
    lock: bool = True,
) -> Iterator[Path]:
    """Write the folder ``dest`` atomically: the block writes into the empty hidden sibling
    it is given (``.<name>.tmp-<host>-<pid>-<random>``); when the block returns, the staged
    folder gets the modes of the process umask (:func:`apply_umask`), is flushed to disk
    (:func:`fsync_tree`) and renamed to ``dest``, and the parent folder is flushed.

    - ``lock=True``: ``.<name>.lock`` next to ``dest`` is held from start to publish
      (:class:`FileLock`, removed after): a second writer of ``dest`` fails at once with
      :class:`FolderBusy` naming the first instead of one output silently replacing the
      other. Under the lock, staging folders of this host's writers of ``dest`` whose
      process is gone are removed first (and said so).
    - ``replace=True``: an existing ``dest`` is renamed aside first and removed after the
      rename (a reader sees the old folder or the new one, never a mix).
    - ``replace=False``: an existing non-empty ``dest`` is an error (:class:`FolderNotEmpty`),
      unless ``peer_done(dest)`` says another process finished the same folder first: then its
      folder is kept and ours is discarded.
    - ``dest`` is compared with what it was at the start before publishing: when anything
      appeared in it, vanished or changed (a user's files, another writer that did not
      lock), nothing is replaced, the finished output moves to
      ``<name>.unpublished-<host>-<pid>-<random>`` and :class:`FolderChanged` names it.
    - When the block (or the publishing) raises, even on an interrupt, the staged folder and
      the parent folders this call created are removed; ``dest`` is as it was.

    Returns through the context manager; the staged folder's path is what the block gets.
    """
    dest = Path(dest).expanduser().absolute()
    if dest.is_symlink():
        # A link to the output folder (issue 32: the link itself was renamed aside and
        # replaced, its ".old" copy never removed, the next write calling it a writer killed
        # midway): the folder it names is written; the link stays and shows the new output.
        dest = Path(os.path.realpath(dest))
    created: List[Path] = []  # parent folders made here, removed again on failure (innermost first)
    p = dest.parent
    while not p.exists():
        created.append(p)
        p = p.parent
    dest.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = dest.parent / f".{dest.name}.tmp-{tag}", dest.parent / f".{dest.name}.old-{tag}"
    held = FileLock(dest.parent / f".{dest.name}.lock", remove=True) if lock else None
    published, kept = False, None
    try:
        if held is not None:
            held.acquire()
            sweep_stale(dest)
        if (
            not replace
            and dest.is_dir()
            and any(dest.iterdir())
            and not (peer_done and peer_done(dest))
        ):
            raise FolderNotEmpty(errno.EEXIST, f"{str(dest)!r} exists and is not empty")
        before = snapshot(dest)
        tmp.mkdir()
        yield tmp
        # safetensors and tempfile write 0600 files; an output is shared like any other
        apply_umask(tmp)
        fsync_tree(tmp)
        now = snapshot(dest)
        if now != before:
            if peer_done is not None and now is not None and peer_done(dest):
                published = True  # a peer published a complete folder first; it is as good as ours
                return
            kept = keep_unpublished(tmp, dest, tag)
            raise FolderChanged(dest, changes(before, now), kept)
        aside = replace and dest.exists()
        if aside:
            os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except OSError:
            if aside:
                os.rename(old, dest)  # the old folder goes back: a failed publish loses nothing
            if peer_done is None or not peer_done(dest):
                raise
            # a peer published a complete folder first; it is as good as ours (removed below)
        published = True
        fsync_path(str(dest.parent), folder=True)
    finally:
        for leftover in (tmp, old):
            if leftover.is_symlink():
                leftover.unlink()
            elif leftover.exists() and leftover != kept:
                shutil.rmtree(leftover, ignore_errors=True)
        if held is not None:
            held.release()
        if not published:
            for c in created:
                try:
                    c.rmdir()
                except OSError:
                    break


def _lock_held(path: Path) -> bool:
    """Whether another process holds the flock on ``path`` (an absent file is not held;
    the file is never created here, so a probe leaves nothing behind)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no locks on this filesystem: nothing to wait for
        return False
    finally:
        os.close(fd)  # closing drops our probe's lock, if taken
    return False


def build_once(
    dest: str | os.PathLike,
    build: Callable[[Path], None],
    done: Callable[[Path], bool],
    *,
    wait_s: float = 1800.0,
    poll_s: float = 0.2,
) -> Path:
    """``dest`` built once by whichever process comes first, every other one waiting for
    it: the assets every rank of a torchrun job asks for at start-up (the tiny-random
    folder, the default model's unpacking). ``build(tmp)`` fills the staging folder of an
    :func:`atomic_folder` (locked, ``replace=False``); ``done(folder)`` says a folder is
    complete. A process that finds the lock held waits until it is released (the builder
    finished, failed or died: the kernel releases the lock of a killed process), then
    uses the finished folder or builds it itself. ``TimeoutError`` naming the holder after
    ``wait_s`` seconds of a held lock (a builder stopped, not dead)."""
    dest = Path(dest).expanduser().absolute()
    lock = dest.parent / f".{dest.name}.lock"
    while True:
        if done(dest):
            return dest
        try:
            with atomic_folder(dest, replace=False, peer_done=done) as tmp:
                build(tmp)
            return dest
        except FolderBusy as busy:
            deadline, said = time.monotonic() + wait_s, False
            while _lock_held(lock):
                if not said:
                    log.info("waiting for %s, being built by %s", dest, busy.holder)
                    said = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{str(dest)!r} has been built by {busy.holder} for over "
                        f"{wait_s:.0f} s; stop that process or remove {str(lock)!r}"
                    ) from None
                time.sleep(poll_s)
