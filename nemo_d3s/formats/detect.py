"""The one answer to "what is in this folder?" (markers only, nothing opened): NeMo 2
(``weights/metadata.json`` + ``context/``), Megatron (``megatron/layout.json``), Megatron-LM /
Megatron-Bridge (``latest_checkpointed_iteration.txt``, or ``metadata.json`` + ``.metadata``)
or Hugging Face (``config.json`` + ``model.safetensors[.index.json]``). A folder with only
``config.json`` is none of these (``ModelSpec.from_folder`` still reads it).
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
    "MEGATRON_LM",
    "SHARDS_SUBDIR",
    "LAYOUT_FILE",
    "FolderFormat",
    "detect_format",
]

HF, MEGATRON, NEMO2, MEGATRON_LM = "hf", "megatron", "nemo2", "megatron_lm"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's (and Megatron-Bridge's) save folder
DIST_MARKERS = ("metadata.json", ".metadata")  # one dist_checkpointing folder (any version)
SHARDS_SUBDIR = "megatron"  # <checkpoint>/megatron/{layout.json, tpXX_ppYY.safetensors}
LAYOUT_FILE = "layout.json"


@dataclass(frozen=True)
class FolderFormat:
    """``kind``: HF, MEGATRON, NEMO2, MEGATRON_LM or None. ``folder``: the checkpoint folder (the
    parent when ``megatron/`` was given); ``shards``: its ``megatron/`` folder (MEGATRON only).
    """

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
    if (p / TRACKER).is_file() or all((p / m).is_file() for m in DIST_MARKERS):
        return FolderFormat(MEGATRON_LM, p)
    if (p / "config.json").is_file() and (
        (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    ):
        return FolderFormat(HF, p)
    return FolderFormat(None, p)
