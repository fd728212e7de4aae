"""What data a run read: path, size and SHA-256 of each file the task reads
(``task.params.*_path``, the ``reward_fn`` file or module), kept in ``DIR/data_files.json`` and
in every checkpoint's run record; ``resume=true`` refuses a file changed since, and a record
that is missing or garbled where the run reads files. Rank 0 runs these.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from nemo_d3s.errors import ConfigError
from nemo_d3s.files import atomic_write_text, sha256_file

__all__ = [
    "DATA_RECORD",
    "check_data_files",
    "data_files",
    "read_data_record",
    "write_data_record",
]

log = logging.getLogger("nemo_d3s.trainer")

DATA_RECORD = "data_files.json"


def _reward_file(spec: str) -> Optional[Path]:
    """The file ``reward_fn`` names: ``file.py:f`` itself, or ``module:f``'s source file (found
    without running the module; None when it cannot be found)."""
    where = spec.rpartition(":")[0]
    if where.endswith(".py"):
        return Path(where).expanduser()
    import importlib.util

    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and origin not in ("built-in", "frozen") else None


def data_files(cfg: Any) -> Dict[str, Dict[str, Any]]:
    """{config key: {"path", "size", "sha256"}} of the files the task reads (absolute
    paths; a key naming no existing file is left out: the task reports it)."""
    params = OmegaConf.to_container(cfg.task.params, resolve=True) if cfg.task.params else {}
    out: Dict[str, Dict[str, Any]] = {}
    for key, value in sorted((params or {}).items()):
        if not isinstance(value, str):
            continue
        if key.endswith("_path"):
            p: Optional[Path] = Path(value).expanduser()
        elif key == "reward_fn" and ":" in value:
            p = _reward_file(value)
        else:
            continue
        if p is not None and p.is_file():
            out[f"task.params.{key}"] = {
                "path": str(p.resolve()),
                "size": p.stat().st_size,
                "sha256": sha256_file(p),
            }
    return out


def write_data_record(files: Dict[str, Dict[str, Any]], out: Path) -> None:
    """Write the run's data_files.json, or remove it when the run reads no file."""
    path = out / DATA_RECORD
    if files:
        atomic_write_text(path, json.dumps({"format": 1, "files": files}, indent=1) + "\n")
    else:
        path.unlink(missing_ok=True)


def _well_formed(files: Any) -> bool:
    return isinstance(files, dict) and all(
        isinstance(k, str)
        and isinstance(v, dict)
        and isinstance(v.get("path"), str)
        and isinstance(v.get("size"), int)
        and isinstance(v.get("sha256"), str)
        for k, v in files.items()
    )


def read_data_record(out: Path) -> Optional[Dict[str, Dict[str, Any]]]:
    """``DIR/data_files.json``'s files, None when absent; a ConfigError naming the file when it
    is garbled or of another shape."""
    path = out / DATA_RECORD
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except Exception:
        files = None
    if not _well_formed(files):
        raise ConfigError(
            f"{str(path)!r} is garbled (not {{'files': {{key: {{'path', 'size', 'sha256'}}}}}}): "
            "what data the run read cannot be checked; restore it, or remove it to resume "
            "without the check"
        )
    return files


def check_data_files(
    recorded: Dict[str, Dict[str, Any]], now: Dict[str, Dict[str, Any]], where: str, allow: bool
) -> None:
    """ConfigError (a warning with ``allow``: ``trainer.allow_config_change``) when a file of the
    run's record (read from ``where``) is gone or changed in ``now`` (:func:`data_files`)."""
    changed = []
    for key, rec in sorted(recorded.items()):
        cur = now.get(key)
        if cur is None:
            changed.append(f"{key}: {rec['path']!r} is gone")
        elif cur["path"] != rec["path"]:
            changed.append(f"{key}: {rec['path']!r} -> {cur['path']!r}")
        elif cur["size"] != rec["size"] or cur["sha256"] != rec["sha256"]:
            changed.append(
                f"{key}: {cur['path']!r} changed since the run read it ({rec['size']} -> "
                f"{cur['size']} bytes, SHA-256 {rec['sha256'][:12]} -> {cur['sha256'][:12]})"
            )
    if not changed:
        return
    what = "; ".join(changed)
    if allow:
        log.warning("resuming on other data (trainer.allow_config_change=true): %s", what)
        return
    raise ConfigError(
        f"resume=true on other data than the run read ({what}; recorded in {where}): "
        "restore the file, or pass trainer.allow_config_change=true to continue on the new data"
    )
