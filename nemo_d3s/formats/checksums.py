"""The ``checksums.json`` check every reader of a checkpoint folder runs before using it.

Training checkpoints (``trainer/checkpoint.py``), converted Megatron checkpoints
(``nemo-d3s-convert hf-to-megatron``) and NeMo 2 checkpoints written by
``nemo-d3s-convert megatron-to-nemo`` carry ``checksums.json`` (size + SHA-256 of every
file, ``files.write_checksums``). The converter's commands and the Megatron backend check
it here. A folder without one: :func:`missing_checksums`, the one policy everywhere (the
trainer calls such a checkpoint of its own unusable too): refused when the folder is of a
kind this project always writes with checksums (a Megatron shard checkpoint, a training
checkpoint; the file was deleted or lost in a copy), read with a warning when it is a
NeMo 2 folder (NeMo writes none). Checking reads every file once (about 1 GB/s per
core; the Megatron backend's ranks share the files, each reading its part, and agree on
the result); the documented switches
``--no-verify-checksums`` and ``model.params.verify_checksums=false`` skip it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nemo_d3s.errors import ConfigError
from nemo_d3s.files import CHECKSUMS, verify_checksums
from nemo_d3s.formats.detect import LAYOUT_FILE, SHARDS_SUBDIR

__all__ = ["CHECKSUMS", "has_checksums", "checksum_error", "check_checksums", "missing_checksums"]

log = logging.getLogger("nemo_d3s.formats")


def has_checksums(folder: str | Path) -> bool:
    return (Path(folder) / CHECKSUMS).is_file()


def checksum_error(folder: str | Path, bad: str, skip_hint: str) -> ConfigError:
    """The one-line error for ``bad`` (what :func:`files.verify_checksums` found)."""
    folder = Path(folder)
    what = "training checkpoint" if (folder / "trainer_state.json").is_file() else "checkpoint"
    return ConfigError(
        f"{str(folder)!r} is not a complete {what}: {bad}; {skip_hint} to use it anyway"
    )


def check_checksums(folder: str | Path, *, skip_hint: str, verify: bool = True) -> None:
    """ConfigError naming ``folder`` and its first bad file when a file does not match
    ``folder/checksums.json`` (missing, truncated, a flipped bit); ``skip_hint`` says how
    to skip the check (the caller's option). Without the file: :func:`missing_checksums`."""
    if not verify:
        return
    if not has_checksums(folder):
        missing_checksums(folder, skip_hint)
        return
    bad = verify_checksums(folder)
    if bad is not None:
        raise checksum_error(folder, bad, skip_hint)


def missing_checksums(folder: str | Path, skip_hint: str) -> None:
    """The one policy for a checkpoint folder without ``checksums.json`` (issue 32: the
    converter and the Megatron backend used such a folder without a word while the
    trainer called it unusable). A kind this project always writes with one (a Megatron
    shard checkpoint ``megatron/layout.json``, a training checkpoint): ConfigError naming
    the folder and ``skip_hint``. Another (a NeMo 2 folder NeMo wrote): a warning."""
    folder = Path(folder)
    ours = (folder / SHARDS_SUBDIR / LAYOUT_FILE).is_file() or (
        folder / "trainer_state.json"
    ).is_file()
    if ours:
        raise ConfigError(
            f"{str(folder)!r} has no {CHECKSUMS}, which this kind of checkpoint is always written "
            f"with (deleted, or lost in a copy), so nothing says its files are whole; restore it "
            f"from the original, or {skip_hint} to use the folder unchecked"
        )
    log.warning("%s has no %s: its files are used unchecked", folder, CHECKSUMS)
