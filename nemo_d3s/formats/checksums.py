"""``checksums.json`` (size + SHA-256 of every file): its one check, shared across the ranks.
:func:`verify_checksums` splits the files into ``world`` shares of about equal bytes, each
rank hashes its own, the findings are all-gathered, so every rank returns the same first
problem. :func:`missing_checksums` is the one policy for a folder without the file.
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
    """``entries`` in ``world`` shares of about equal bytes (largest file first to the lightest
    share, ties to the lower rank): the same split on every rank, max <= fair share + one file.
    """
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
    """None when every file ``folder/checksums.json`` lists matches its size and SHA-256, else the
    first problem (naming the file), the same on every rank. Collective over ``gather`` (None: one
    process); this rank reads share ``rank`` only. ``found``: a problem already found (no reads).
    """
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
    """ConfigError on every rank naming ``folder`` and its first bad file; ``skip_hint`` says how to
    skip the check. Without the file: :func:`missing_checksums`.
    """
    if not verify:
        return
    if not has_checksums(folder):
        missing_checksums(folder, skip_hint)
        return
    bad = verify_checksums(folder, rank=rank, world=world, gather=gather)
    if bad is not None:
        raise checksum_error(folder, bad, skip_hint)


def missing_checksums(folder: str | Path, skip_hint: str) -> None:
    """A folder without ``checksums.json``: ConfigError naming it and ``skip_hint`` when this
    project always writes one there (``megatron/layout.json``, a training checkpoint); else
    (NeMo 2) a warning.
    """
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
