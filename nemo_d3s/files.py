"""Small file-system helpers shared by the trainer and the backends (no torch, no model code).

- :func:`apply_umask`: files written through ``tempfile`` (as safetensors and some
  ``save_pretrained`` paths do) are created mode 0600; an export must be readable by
  colleagues on a shared cluster like every other file of the run, so the modes of a
  written folder are reset to what the process umask gives a normally created file.
- :func:`sha256_file`: the checksum stored for every checkpoint file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["current_umask", "apply_umask", "sha256_file"]


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
