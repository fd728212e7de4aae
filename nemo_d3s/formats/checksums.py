"""The ``checksums.json`` check every reader of a checkpoint folder runs before using it.

Training checkpoints (``trainer/checkpoint.py``), converted Megatron checkpoints
(``nemo-d3s-convert hf-to-megatron``) and NeMo 2 checkpoints written by
``nemo-d3s-convert megatron-to-nemo`` carry ``checksums.json`` (size + SHA-256 of every
file, ``files.write_checksums``). The converter's commands and the Megatron backend check
it here; a folder without one (written by NeMo itself, or by an older version) is read as
it is. Checking reads every file once (about 1 GB/s per core; the Megatron backend's ranks
share the files, each reading its part, and agree on the result); the documented switches
``--no-verify-checksums`` and ``model.params.verify_checksums=false`` skip it.
"""

from __future__ import annotations

from pathlib import Path

from nemo_d3s.errors import ConfigError
from nemo_d3s.files import CHECKSUMS, verify_checksums

__all__ = ["CHECKSUMS", "has_checksums", "checksum_error", "check_checksums"]


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
    to skip the check (the caller's option). Nothing to check without the file."""
    if not verify or not has_checksums(folder):
        return
    bad = verify_checksums(folder)
    if bad is not None:
        raise checksum_error(folder, bad, skip_hint)
