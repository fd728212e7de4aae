"""``checksums.json``: its one check, shared across the ranks present.

Training checkpoints (``trainer/checkpoint.py``), converted Megatron checkpoints
(``nemo-d3s-convert hf-to-megatron``) and NeMo 2 checkpoints written by
``nemo-d3s-convert megatron-to-nemo`` carry ``checksums.json`` (size + SHA-256 of every
file, ``files.write_checksums``; a training checkpoint's ranks each hash the files they
wrote, right after writing them, and rank 0 merges the digests). The converter's commands
and the Megatron backend check it here. A folder without one: :func:`missing_checksums`,
the one policy everywhere (the trainer calls such a checkpoint of its own unusable too):
refused when the folder is of a kind this project always writes with checksums (a Megatron
shard checkpoint, a training checkpoint; the file was deleted or lost in a copy), read with
a warning when it is a NeMo 2 folder (NeMo writes none); the documented switches
``--no-verify-checksums`` and ``model.params.verify_checksums=false`` skip the check.

One routine, one policy (:func:`verify_checksums`): the listed files are split into
``world`` shares of about equal bytes (:func:`checksum_shares`, the same split on every
rank), each rank reads its share only (about 1 GB/s per core: a 70B checkpoint with its
optimizer state is ~1 TB, so its 64 ranks read ~16 GB each instead of one rank reading it
all while the others wait), and the ranks' findings are all-gathered (``gather``, from
``distributed.agree.all_gather_texts``), so every rank returns the same first problem (in
rank order) and raises the same error. One process is the one-rank case. No pickle.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from nemo_d3s import files
from nemo_d3s.errors import ConfigError
from nemo_d3s.files import CHECKSUMS
from nemo_d3s.formats.detect import LAYOUT_FILE, SHARDS_SUBDIR

__all__ = [
    "CHECKSUMS",
    "Gather",
    "checksum_entries",
    "checksum_shares",
    "verify_checksums",
    "has_checksums",
    "checksum_error",
    "check_checksums",
    "missing_checksums",
]

log = logging.getLogger("nemo_d3s.formats")

# every rank's finding (None: nothing wrong), in rank order, on every rank
Gather = Callable[[Optional[str]], List[Optional[str]]]
Entry = Tuple[str, int, str]  # (relative path, size in bytes, SHA-256)


def has_checksums(folder: str | Path) -> bool:
    """Whether ``folder`` holds a ``checksums.json``."""
    return (Path(folder) / CHECKSUMS).is_file()


def checksum_entries(folder: str | Path) -> Tuple[List[Entry], Optional[str]]:
    """(the entries of ``folder/checksums.json`` sorted by path, None) or ([], what is wrong)."""
    try:
        raw = json.loads((Path(folder) / CHECKSUMS).read_text(encoding="utf-8"))
        items = [(str(k), int(v["size"]), str(v["sha256"])) for k, v in raw["files"].items()]
    except FileNotFoundError:
        return [], f"no {CHECKSUMS}"
    except Exception as e:  # garbled JSON, a missing key, a wrong type: all one answer
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        return [], f"{CHECKSUMS} is garbled ({why})"
    return sorted(items), None


def checksum_shares(entries: List[Entry], world: int) -> List[List[Entry]]:
    """``entries`` split into ``world`` shares of about equal bytes: largest file first, each
    to the share with the fewest bytes so far (ties: the lower rank). A pure function of the
    entries, so every rank computes the same split. The largest share is at most the fair
    share plus one file."""
    shares: List[List[Entry]] = [[] for _ in range(world)]
    load = [0] * world
    for e in sorted(entries, key=lambda e: (-e[1], e[0])):
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r].append(e)
        load[r] += e[1]
    return [sorted(s) for s in shares]


def _first_bad(folder: Path, share: List[Entry]) -> Optional[str]:
    real = folder.resolve()
    for rel, size, digest in share:
        f = (folder / rel).resolve()
        if real not in f.parents:
            return f"{CHECKSUMS} names {rel!r}, outside the folder"
        if not f.is_file():
            return f"{rel} is missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{rel} has {actual} bytes, {size} were written (truncated or overwritten)"
        if files.sha256_file(f) != digest:
            return f"{rel} does not match its SHA-256 checksum (corrupt)"
    return None


def verify_checksums(
    folder: str | Path,
    *,
    rank: int = 0,
    world: int = 1,
    gather: Optional[Gather] = None,
    found: Optional[str] = None,
) -> Optional[str]:
    """None when every file ``folder/checksums.json`` lists exists with its size and
    SHA-256; else the first problem, in a few words naming the file, the same on every rank.
    Collective over the ``world`` ranks ``gather`` reaches (None: one process): this rank
    reads share ``rank`` of :func:`checksum_shares` only. ``found``: a problem this rank
    already found (nothing is read then; the ranks still agree)."""
    if found is None:
        entries, found = checksum_entries(folder)
        if found is None:
            found = _first_bad(Path(folder), checksum_shares(entries, world)[rank])
    findings = gather(found) if gather is not None and world > 1 else [found]
    return next((f for f in findings if f is not None), None)


def checksum_error(folder: str | Path, bad: str, skip_hint: str) -> ConfigError:
    """The one-line error for ``bad`` (what :func:`verify_checksums` found)."""
    folder = Path(folder)
    what = "training checkpoint" if (folder / "trainer_state.json").is_file() else "checkpoint"
    return ConfigError(
        f"{str(folder)!r} is not a complete {what}: {bad}; {skip_hint} to use it anyway"
    )


def check_checksums(
    folder: str | Path,
    *,
    skip_hint: str,
    verify: bool = True,
    rank: int = 0,
    world: int = 1,
    gather: Optional[Gather] = None,
) -> None:
    """ConfigError naming ``folder`` and its first bad file when a file does not match
    ``folder/checksums.json`` (missing, truncated, a flipped bit), raised on every rank
    (:func:`verify_checksums`); ``skip_hint`` says how to skip the check (the caller's
    option). Without the file: :func:`missing_checksums`."""
    if not verify:
        return
    if not has_checksums(folder):
        missing_checksums(folder, skip_hint)
        return
    bad = verify_checksums(folder, rank=rank, world=world, gather=gather)
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
