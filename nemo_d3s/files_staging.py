"""The staging side of :func:`nemo_d3s.files.atomic_folder` (a leaf: the standard library
only): how a staging folder is named (``.<name>.tmp-<host>-<pid>-<random>``, and ``.old-``
for a folder renamed aside), finding them (:func:`staging_folders`), sweeping what writers
killed midway on this host left (:func:`sweep_stale`), and the before/after snapshot of the
destination that refuses to publish over a folder that changed meanwhile (:func:`snapshot`,
:func:`changes`, :func:`keep_unpublished`)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Dict, List, Optional, Tuple

__all__ = [
    "changes",
    "host_tag",
    "keep_unpublished",
    "snapshot",
    "staging_folders",
    "sweep_stale",
]

# atomic_folder's logger: the sweep's notices are the folder writer's
log = logging.getLogger("nemo_d3s.files")


def host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def _staging_re(name: str) -> "re.Pattern[str]":
    return re.compile(
        rf"^\.{re.escape(name)}\.(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}$"
    )


def staging_folders(dest: str | os.PathLike) -> List[Tuple[Path, str, str, int]]:
    """(path, "tmp" or "old", host, pid) of the staging / renamed-aside siblings of ``dest``
    that :func:`atomic_folder` names ``.<name>.tmp-<host>-<pid>-<random>``."""
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
    """Remove what writers of ``dest`` killed midway left (their process is gone). Only
    this host's: a pid of another host on a shared filesystem says nothing here. A folder
    renamed aside (``.old-``) by a writer killed before it published is the user's previous
    output: it is put back when ``dest`` is missing, removed when ``dest`` replaced it."""
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
    """What ``p`` is (None: absent): its inode and, for a folder, every entry below it with
    kind, size and modification time; compared before publishing."""
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
    """Move the finished staging folder to a visible name next to ``dest`` that no later
    write sweeps away (the staging name would be swept once this process is gone)."""
    kept = dest.parent / f"{dest.name}.unpublished-{tag}"
    try:
        os.rename(tmp, kept)
        return kept
    except OSError:
        return tmp
