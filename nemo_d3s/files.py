"""File-system helpers every layer may use (a leaf: no torch, no model code).

- :func:`atomic_folder`: THE way a folder of outputs is written (the converter's outputs,
  both backends' Hugging Face exports, the default model's GGUF unpacking): staged in a
  hidden sibling, flushed to disk, renamed into place; nothing half-written is ever found
  under the final name, and what a failed write created is removed again.
- :func:`apply_umask`: files written through ``tempfile`` (as safetensors and some
  ``save_pretrained`` paths do) are created mode 0600; an export must be readable by
  colleagues on a shared cluster like every other file of the run, so the modes of a
  written folder are reset to what the process umask gives a normally created file.
- :func:`sha256_file`: the checksum stored for every checkpoint file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional

__all__ = ["current_umask", "apply_umask", "sha256_file", "fsync_tree", "atomic_folder"]


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
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _fsync_path(path: str, *, folder: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file and folder under ``root`` (and ``root``) to disk, so that a rename
    that publishes ``root`` cannot survive a crash that its contents do not."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                _fsync_path(p, folder=False)
        _fsync_path(dirpath, folder=True)


@contextmanager
def atomic_folder(dest: str | os.PathLike, *, replace: bool = True,
                  peer_done: Optional[Callable[[Path], bool]] = None) -> Iterator[Path]:
    """Write the folder ``dest`` atomically: the block writes into the empty hidden sibling
    it is given (``.<name>.tmp-<pid>-<random>``); when the block returns, the staged folder
    gets the modes of the process umask (:func:`apply_umask`), is flushed to disk
    (:func:`fsync_tree`) and renamed to ``dest``, and the parent folder is flushed.

    - ``replace=True``: an existing ``dest`` is renamed aside first and removed after the
      rename (a reader sees the old folder or the new one, never a mix).
    - ``replace=False``: an existing non-empty ``dest`` is an error (OSError), unless
      ``peer_done(dest)`` says another process finished the same folder first: then its
      folder is kept and ours is discarded.
    - When the block (or the publishing) raises, even on an interrupt, the staged folder and
      the parent folders this call created are removed; ``dest`` is as it was.

    Returns through the context manager; the staged folder's path is what the block gets.
    """
    dest = Path(dest).expanduser().absolute()
    created: List[Path] = []  # parent folders made here, removed again on failure (innermost first)
    p = dest.parent
    while not p.exists():
        created.append(p)
        p = p.parent
    dest.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = dest.parent / f".{dest.name}.tmp-{tag}", dest.parent / f".{dest.name}.old-{tag}"
    published = False
    try:
        tmp.mkdir()
        yield tmp
        apply_umask(tmp)  # safetensors and tempfile write 0600 files; an output is shared like any other
        fsync_tree(tmp)
        if replace and dest.exists():
            try:
                os.rename(dest, old)
            except FileNotFoundError:
                pass  # a peer moved it away first
        try:
            os.rename(tmp, dest)
        except OSError:
            if peer_done is None or not peer_done(dest):
                raise
            # a peer published a complete folder first; it is as good as ours (removed below)
        published = True
        _fsync_path(str(dest.parent), folder=True)
    finally:
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
        if not published:
            for c in created:
                try:
                    c.rmdir()
                except OSError:
                    break
