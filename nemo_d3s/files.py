"""File-system helpers every layer may use (a leaf: no torch, no model code).

:func:`atomic_folder` is THE way a folder of outputs is written: staged in a hidden sibling,
flushed, renamed into place, locked against a second writer, never published over a folder that
changed meanwhile; nothing half-written is ever found under the final name.
:func:`atomic_write_text` does the same for one file. Outputs get the umask's modes (files
``tempfile`` creates are 0600, unreadable to colleagues on a shared cluster), and checkpoints carry
``checksums.json`` (size + SHA-256 per file)."""

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
    looks_like_write_failure,
    snapshot,
    space_note,
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
    "looks_like_write_failure",  # files_staging's, re-exported
    "space_note",  # files_staging's, re-exported
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
    """Give ``path`` (recursively) the modes a plain ``open``/``mkdir`` would: 0666 / 0777 & ~umask.
    Symlinks are left alone."""
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
    """Write ``folder/checksums.json`` last: size and SHA-256 of every file under ``folder``
    (relative POSIX paths). ``digests``: entries other processes computed for their files (from
    :func:`file_digests`); only the rest is read here."""
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
    """{rel: {"size", "sha256"}} of the files ``rels`` under ``folder``."""
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
    """Exclusive advisory ``flock`` on ``path`` (created when missing), without waiting: a held lock
    is :class:`FolderBusy` naming the holder's pid, host and start time. The kernel releases it when
    the holder dies; a filesystem without locks (Lustre without ``-o flock``) skips it with a
    warning.

    ``remove=True`` unlinks the file on release; the acquirer then checks that it locked the inode
    still at ``path`` and retries otherwise, so two processes never lock two inodes of one name.
    ``on_acquired``: called once locked, before the holder is written."""

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
    """The output folder changed while being written; nothing was replaced, the finished output is
    kept at ``kept``."""

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
    """Write the folder ``dest`` atomically: the block fills the empty hidden sibling it is given;
    on return it gets the umask's modes, is flushed and renamed to ``dest``, and the parent is
    flushed.

    - ``lock=True``: ``.<name>.lock`` is held until publishing, so a second writer fails at once
      with :class:`FolderBusy`; stale staging folders of this host's dead writers are removed first.
    - ``replace=True``: an existing ``dest`` is renamed aside, removed after the rename (a reader
      sees the old folder or the new one).
    - ``replace=False``: a non-empty ``dest`` is :class:`FolderNotEmpty`, unless ``peer_done(dest)``
      says another process finished it: ours is discarded.
    - If ``dest`` changed meanwhile nothing is replaced: the output moves to
      ``<name>.unpublished-<host>-<pid>-<random>`` and :class:`FolderChanged` names it.
    - On an exception (an interrupt included) the staged folder and the parents this call created
      are removed; ``dest`` is as it was."""
    dest = Path(dest).expanduser().absolute()
    if dest.is_symlink():
        # Write the folder a link names and keep the link: renaming the link aside would leave
        # a ".old" copy that the next write takes for a killed writer's.
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
    """Whether another process holds the flock on ``path`` (never creates the file)."""
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
    """``dest`` built once by whichever process comes first, the others waiting: ``build(tmp)``
    fills a locked :func:`atomic_folder` (``replace=False``), ``done(folder)`` says one is complete.
    A waiter uses the finished folder, or builds it when the builder failed or died.
    ``TimeoutError`` naming the holder after ``wait_s`` seconds of a held lock."""
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
