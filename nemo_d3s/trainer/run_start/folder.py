"""The run directory: usable, not used by another run, free of another run's records.
:class:`RunDirLock` is held by global rank 0 for the whole run (the kernel drops it when the
process dies); :func:`move_aside` moves earlier records into ``DIR/previous-<n>/``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional

from nemo_d3s.errors import ConfigError
from nemo_d3s.files import FileLock, FolderBusy, space_note
from nemo_d3s.trainer.faults import RunError, fault_point

__all__ = [
    "LOCK_NAME",
    "RECORDS",
    "RUN_CONFIG_KEYS",
    "RunDirLock",
    "check_output_dir",
    "foreign_entries",
    "is_run_config",
    "records",
    "move_aside",
]

log = logging.getLogger("nemo_d3s.trainer")

LOCK_NAME = ".nemo_d3s.lock"
# What a run writes that is worth keeping (config.yaml is written again at every start).
RECORDS = ("metrics.jsonl", "eval.jsonl", "summary.json", "hf_export")
# Every name a run (and Hydra's job logging) writes at the top of its folder; anything else
# there is a user's, and a run never writes beside it (``output_dir=conf`` would replace
# the project's own conf/config.yaml).
RUN_NAMES = frozenset(
    {
        LOCK_NAME,
        ".hydra",
        "config.yaml",
        "train.log",
        "checkpoints",
        "tensorboard",
        "interrupted.json",
        "data_files.json",
        # what slurm/*.sbatch write there: rank logs, the dry run's plan, the self-check
        "logs",
        "dry_run.json",
        "dry_run.layout",
        "selfcheck",
        *RECORDS,
        *(f"{r}.garbled" for r in RECORDS),
    }
)
_RUN_NAME = re.compile(
    r"^(previous-\d+|config\.resumed-\d+\.yaml|\.hf_export\..+|\.write_probe_.+"
    r"|train\.rank\d+\.log|vllm_engine(_rank\d+)?\.log)$"
)
# What every run's config holds at its top level (a file without them is not a run's).
RUN_CONFIG_KEYS = ("output_dir", "model", "trainer", "task")


def check_output_dir(path: str, *, create: bool = True) -> Path:
    """``path`` as a writable directory (created when missing and ``create``), or one clear
    error naming it. Nothing existing is modified."""
    if path is None or not str(path).strip():
        raise ConfigError(
            "output_dir='': must name a directory (an empty path would write into the "
            "current folder)"
        )
    p = Path(str(path)).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"output_dir={str(p)!r} is a file, not a directory; choose another output_dir"
        )
    if not p.exists():
        if not create:
            parent = _existing_parent(p)
            if parent is not None and not parent.is_dir():
                raise ConfigError(
                    f"output_dir={str(p)!r}: {str(parent)!r} is a file, not a directory"
                )
            if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
                raise RunError(
                    f"output_dir={str(p)!r} cannot be created: {str(parent)!r} is not writable"
                )
            if parent is not None:  # room for what Hydra and the run's start write there
                try:
                    _probe_write(parent)
                except OSError as e:
                    raise _not_writable(
                        p, e, f"in {str(parent)!r}, where it would be made"
                    ) from None
            return p
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"output_dir={str(p)!r} cannot be created: {e.strerror or e}") from None
    refuse_foreign(p)
    try:  # os.access does not see every read-only mount or a full disk; real bytes do
        _probe_write(p)
    except OSError as e:
        raise _not_writable(p, e) from None
    return p


def _not_writable(p: Path, e: OSError, where: str = "") -> RunError:
    room = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    notes = [n for n in (where, space_note(p if p.exists() else p.parent) if room else "") if n]
    return RunError(
        f"output_dir={str(p)!r} is not writable: {e.strerror or e}"
        + (f" ({'; '.join(notes)})" if notes else "")
    )


def foreign_entries(run_dir: str | os.PathLike) -> List[str]:
    """Names at the top of ``run_dir`` that no run writes (sorted; empty for a new folder),
    and ``config.yaml`` when it is not a run's config (not a mapping with the run's keys)."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = sorted(
        e.name for e in d.iterdir() if e.name not in RUN_NAMES and not _RUN_NAME.match(e.name)
    )
    # A folder with a run's lock or checkpoints is a run's: its config.yaml, even garbled,
    # is the resume checks' business. Without them a config.yaml must read as a run's.
    cfg = d / "config.yaml"
    ours = (d / LOCK_NAME).exists() or (d / "checkpoints").exists()
    if not ours and cfg.is_file() and not _is_run_config(cfg):
        found.insert(0, "config.yaml (not a run's config)")
    return found


def _is_run_config(path: Path) -> bool:
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return is_run_config(raw)


def is_run_config(raw: object) -> bool:
    """A mapping with the keys every run's config has (``output_dir``, ``model``, ...)."""
    return isinstance(raw, dict) and all(k in raw for k in RUN_CONFIG_KEYS)


def refuse_foreign(run_dir: Path) -> None:
    """ConfigError unless ``run_dir`` is new, empty or an earlier run's folder (a run would
    overwrite a user's config.yaml, train.log, ...).
    """
    found = foreign_entries(run_dir)
    if found:
        listing = ", ".join(found[:4]) + (" ..." if len(found) > 4 else "")
        raise ConfigError(
            f"output_dir={str(run_dir)!r} holds files that are not a run's ({listing}); a run "
            "writes only into a new or empty folder or an earlier run's: choose another output_dir"
        )


# What the probe writes: more than Hydra's .hydra/ files and the run's first records.
_PROBE_BYTES = 64 * 1024


def _probe_write(p: Path) -> None:
    """Write, flush and remove a file of ``_PROBE_BYTES`` in ``p`` (an empty file would pass
    on a full disk)."""
    fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=p)
    try:
        left = memoryview(bytes(_PROBE_BYTES))
        while left:  # a write cut short at a limit returns a short count; the next one fails
            left = left[os.write(fd, left) :]
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def _existing_parent(p: Path) -> Optional[Path]:
    for parent in p.absolute().parents:
        if parent.exists():
            return parent
    return None


class RunDirLock:
    """Exclusive ``files.FileLock`` on ``DIR/.nemo_d3s.lock``; a refusal is a RunError naming the
    holder.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        # The file stays: the run folder holds it for the run's whole life.
        self._lock = FileLock(self.path, on_acquired=lambda: fault_point("lock.acquired"))

    @property
    def fd(self) -> Optional[int]:
        return self._lock.fd

    def acquire(self) -> "RunDirLock":
        try:
            self._lock.acquire()
        except FolderBusy as e:
            raise RunError(
                f"output_dir={str(self.path.parent)!r} is in use by another run "
                f"({e.holder}); wait for it to end, or choose another output_dir"
            ) from None
        except OSError as e:
            raise RunError(f"cannot lock {str(self.path)!r}: {e.strerror or e}") from None
        return self

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def records(run_dir: str | os.PathLike) -> List[str]:
    """Names of non-empty records of a previous run in ``run_dir``."""
    d = Path(run_dir)
    found = []
    for name in RECORDS:
        p = d / name
        if p.is_dir() and any(p.iterdir()):
            found.append(name)
        elif p.is_file() and p.stat().st_size > 0:
            found.append(name)
    return found


def move_aside(run_dir: str | os.PathLike, names: List[str]) -> Path:
    """Move ``names`` (and config.yaml and the logs: the new run's train.log must not carry on
    the earlier run's lines) of ``run_dir`` into a new ``previous-<n>/`` folder."""
    d = Path(run_dir)
    n = 1
    while (d / f"previous-{n}").exists():
        n += 1
    dest = d / f"previous-{n}"
    dest.mkdir()
    logs = sorted(p.name for p in d.iterdir() if _RUN_NAME.match(p.name) and p.suffix == ".log")
    for name in [*names, "config.yaml", "train.log", *logs]:
        if (d / name).exists():
            shutil.move(str(d / name), str(dest / name))
    return dest
