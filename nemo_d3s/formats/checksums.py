"""The ``checksums.json`` check every reader of a checkpoint folder runs before using it.

Training checkpoints (``trainer/checkpoint.py``), converted Megatron checkpoints
(``nemo-d3s-convert hf-to-megatron``) and NeMo 2 checkpoints written by
``nemo-d3s-convert megatron-to-nemo`` carry ``checksums.json`` (size + SHA-256 of every
file, ``files.write_checksums``). The converter's commands and the Megatron backend check
it here; a folder without one (written by NeMo itself, or by an older version) is read as
it is. Checking reads every file once (about 1 GB/s per core); the documented switches
``--no-verify-checksums`` and ``model.params.verify_checksums=false`` skip it.
"""

from __future__ import annotations

from pathlib import Path

from nemo_d3s.errors import ConfigError
from nemo_d3s.files import CHECKSUMS, verify_checksums

__all__ = ["CHECKSUMS", "check_checksums"]


def check_checksums(folder: str | Path, *, skip_hint: str, verify: bool = True) -> None:
    """ConfigError naming ``folder`` and its first bad file when a file does not match
    ``folder/checksums.json`` (missing, truncated, a flipped bit); ``skip_hint`` says how
    to skip the check (the caller's option). Nothing to check without the file."""
    folder = Path(folder)
    if not verify or not (folder / CHECKSUMS).is_file():
        return
    bad = verify_checksums(folder)
    if bad is not None:
        what = "training checkpoint" if (folder / "trainer_state.json").is_file() else "checkpoint"
        raise ConfigError(f"{str(folder)!r} is not a complete {what}: {bad}; {skip_hint} to use it anyway")
