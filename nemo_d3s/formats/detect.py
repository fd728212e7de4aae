"""The one answer to "what is in this folder?": a Hugging Face model, a Megatron sharded
checkpoint (a training ``step_XXXXXX`` folder or a converted one) or a NeMo 2 checkpoint.

The Megatron backend, the converter and the dry run ask :func:`detect_format`; none of them
looks for marker files itself. The markers (files only, nothing is opened):

- NeMo 2: ``weights/metadata.json`` and a ``context/`` folder (``nemo2.py``).
- Megatron: ``megatron/layout.json`` (``shards.py``), or the ``megatron/`` folder itself.
- Hugging Face: ``config.json`` with ``model.safetensors`` or ``model.safetensors.index.json``.

A folder holding only ``config.json`` (what the dry run plans from) is none of these: its
:class:`~nemo_d3s.formats.spec.ModelSpec` is still read from ``config.json``
(``ModelSpec.from_folder``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = [
    "HF",
    "MEGATRON",
    "NEMO2",
    "SHARDS_SUBDIR",
    "LAYOUT_FILE",
    "FolderFormat",
    "detect_format",
]

HF, MEGATRON, NEMO2 = "hf", "megatron", "nemo2"
SHARDS_SUBDIR = "megatron"  # <checkpoint>/megatron/{layout.json, tpXX_ppYY.safetensors}
LAYOUT_FILE = "layout.json"


@dataclass(frozen=True)
class FolderFormat:
    """``kind``: HF, MEGATRON or NEMO2, or None (none of them). ``folder``: the checkpoint
    folder (the parent when ``megatron/`` itself was given); ``shards``: its ``megatron/``
    folder (MEGATRON only)."""

    kind: Optional[str]
    folder: Path
    shards: Optional[Path] = None

    @property
    def training(self) -> bool:
        """A trainer's checkpoint (it carries trainer_state.json), not a converted folder
        (both carry checksums.json)."""
        return self.kind == MEGATRON and (self.folder / "trainer_state.json").is_file()


def detect_format(path: str | os.PathLike) -> FolderFormat:
    """What ``path`` holds (module docstring); checks for files only."""
    p = Path(path)
    if (p / "weights" / "metadata.json").is_file() and (p / "context").is_dir():
        return FolderFormat(NEMO2, p)
    if (p / SHARDS_SUBDIR / LAYOUT_FILE).is_file():
        return FolderFormat(MEGATRON, p, p / SHARDS_SUBDIR)
    if p.name == SHARDS_SUBDIR and (p / LAYOUT_FILE).is_file():
        return FolderFormat(MEGATRON, p.parent, p)
    if (p / "config.json").is_file() and (
        (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    ):
        return FolderFormat(HF, p)
    return FolderFormat(None, p)
