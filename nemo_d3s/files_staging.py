"""The staging side of :func:`nemo_d3s.files.atomic_folder` (a leaf: the standard library only):
staging names (``.<name>.tmp-<host>-<pid>-<random>``, ``.old-`` for a folder renamed aside),
sweeping what killed writers left, the before/after snapshot that refuses to publish over a changed
folder, and flushing (:func:`fsync_tree`, :func:`atomic_write_text`). ``nemo_d3s.files`` re-exports
them."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Container, Dict, List, Optional, Tuple

__all__ = [
    "atomic_write_text",
    "looks_like_write_failure",
    "space_note",
    "changes",
    "fsync_folder",
    "fsync_tree",
    "host_tag",
    "keep_unpublished",
    "snapshot",
    "staging_folders",
    "sweep_stale",
]

# atomic_folder's logger: the sweep's notices are the folder writer's
log = logging.getLogger("nemo_d3s.files")


def host_tag() -> str:
    """This host's name made safe for a staging folder's name."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def _staging_re(name: str) -> "re.Pattern[str]":
    return re.compile(
        rf"^\.{re.escape(name)}\.(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}$"
    )


def staging_folders(dest: str | os.PathLike) -> List[Tuple[Path, str, str, int]]:
    """(path, "tmp" or "old", host, pid) of ``dest``'s staging and renamed-aside siblings."""
    dest = Path(dest)
    pat = _staging_re(dest.name)
    out = []
    if dest.parent.is_dir():
        for p in sorted(dest.parent.iterdir()):
            m = pat.match(p.name)
            if m:
                out.append((p, m.group("kind"), m.group("host"), int(m.group("pid"))))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's live process
        return True
    return True


def sweep_stale(dest: Path) -> None:
    """Remove what this host's writers of ``dest`` killed midway left (another host's pid says
    nothing here). A renamed-aside ``.old-`` folder is the user's previous output: put back when
    ``dest`` is missing, removed when ``dest`` replaced it."""
    for path, kind, host, pid in staging_folders(dest):
        if host != host_tag() or pid == os.getpid() or _alive(pid):
            continue
        if kind == "old" and not dest.exists():
            os.rename(path, dest)
            log.warning(
                "restored %s from %s, where a write killed midway (pid %d, no longer "
                "running) had moved it",
                dest,
                path.name,
                pid,
            )
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning(
            "removed %s: left by a write of %s killed midway (pid %d on this host, no "
            "longer running)",
            path,
            dest.name,
            pid,
        )


def snapshot(p: Path) -> Optional[Tuple]:
    """What ``p`` is (None: absent): its inode and, for a folder, every entry's kind, size and
    mtime; compared before publishing."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    if not os.path.isdir(p) or os.path.islink(p):
        return ("file", st.st_ino, st.st_size, st.st_mtime_ns)
    entries: Dict[str, Tuple] = {}
    for dirpath, dirnames, filenames in os.walk(p):
        for n in dirnames + filenames:
            full = os.path.join(dirpath, n)
            try:
                e = os.lstat(full)
            except FileNotFoundError:
                continue
            entries[os.path.relpath(full, p)] = (n in dirnames, e.st_size, e.st_mtime_ns)
    return ("dir", st.st_ino, entries)


def changes(before: Optional[Tuple], now: Optional[Tuple]) -> str:
    """How a destination changed between two snapshots, in words (for the refusal)."""
    if before is None:
        return "it appeared"
    if now is None:
        return "it was removed"
    if before[0] != "dir" or now[0] != "dir" or before[1] != now[1]:
        return "it was replaced"
    old, new = before[2], now[2]
    added = sorted(set(new) - set(old))
    gone = sorted(set(old) - set(new))
    changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    parts = [
        f"{label}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        for label, names in (("new", added), ("removed", gone), ("modified", changed))
        if names
    ]
    return "; ".join(parts) or "it was modified"


def keep_unpublished(tmp: Path, dest: Path, tag: str) -> Path:
    """Move the finished staging folder to a visible name next to ``dest`` that no sweep removes."""
    kept = dest.parent / f"{dest.name}.unpublished-{tag}"
    try:
        os.rename(tmp, kept)
        return kept
    except OSError:
        return tmp


# ---------------------------------------------------------------------------- flushing
def fsync_path(path: str, *, folder: bool) -> None:
    """fsync the file (or, ``folder``, the folder) at ``path``."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path: str | os.PathLike) -> None:
    """Flush the folder ``path`` itself (its entries: what a rename into it changed)."""
    fsync_path(str(path), folder=True)


def fsync_tree(root: str | os.PathLike, flushed: Container[str] = ()) -> None:
    """Flush every file and folder under ``root`` (and ``root``), so a rename publishing ``root``
    cannot survive a crash its contents do not; ``flushed``: files (paths relative to ``root``,
    "/"-separated) their writers flushed already."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.relpath(p, root).replace(os.sep, "/") in flushed or os.path.islink(p):
                continue
            fsync_path(p, folder=False)
        fsync_path(dirpath, folder=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically through a flushed hidden sibling renamed over
    it, then flush the folder: a reader or a crash sees the old file or the new one. A failure
    removes the sibling; the folder must exist."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(str(path.parent), folder=True)
    return path


def looks_like_write_failure(e: BaseException) -> bool:
    """An exception a failed write raises: OSError, torch's zip writer's RuntimeErrors (and
    torch.distributed.checkpoint's CheckpointException carrying them), or the safetensors
    library's error wrapping an I/O error (a full disk, a file-size limit). megatron-core
    0.19.2's writer keeps only the text of the OSError its worker raised ("An error is caught
    while starting worker 0, error: <class 'OSError'>", filesystem_async.py:330)."""
    if isinstance(e, OSError):
        return True
    kinds = ("SafetensorError", "CheckpointException")
    return (isinstance(e, RuntimeError) or type(e).__name__ in kinds) and any(
        s in str(e)
        for s in (
            "unexpected pos",
            "PytorchStreamWriter",
            "file write failed",
            "No space left",
            "File too large",
            "IoError",
            "<class 'OSError'>",
        )
    )


def space_note(path: str | os.PathLike) -> str:
    """What a failed write under ``path`` may have run out of: the free space there and, when
    this process has one, its file-size limit (``ulimit -f``; writes past it fail however much
    space is free)."""
    try:
        free = f"{shutil.disk_usage(path).free / 2**20:.0f} MiB free there"
    except OSError:
        free = "free space unknown"
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return free
    if limit == resource.RLIM_INFINITY:
        return free
    return f"this process's file-size limit (ulimit -f) is {limit} bytes; {free}"
