"""``DIR/data_files.json``: path, size and SHA-256 of each file the task reads
(``task.params.*_path``, the ``reward_fn`` file), written by a fresh run; ``resume=true``
refuses a file changed since. Rank 0 runs these.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict

from omegaconf import OmegaConf

from nemo_d3s.errors import ConfigError
from nemo_d3s.files import sha256_file

__all__ = ["DATA_RECORD", "data_files", "write_data_record", "check_data_record"]

log = logging.getLogger("nemo_d3s.trainer")

DATA_RECORD = "data_files.json"


def data_files(cfg: Any) -> Dict[str, Dict[str, Any]]:
    """{config key: {"path", "size", "sha256"}} of the files the task reads (absolute
    paths; a key naming no existing file is left out: the task reports it)."""
    params = OmegaConf.to_container(cfg.task.params, resolve=True) if cfg.task.params else {}
    out: Dict[str, Dict[str, Any]] = {}
    for key, value in sorted((params or {}).items()):
        if not isinstance(value, str):
            continue
        if key.endswith("_path"):
            where = value
        elif key == "reward_fn" and ".py:" in value:
            where = value.rpartition(":")[0]
        else:
            continue
        p = Path(where).expanduser()
        if p.is_file():
            out[f"task.params.{key}"] = {
                "path": str(p.resolve()),
                "size": p.stat().st_size,
                "sha256": sha256_file(p),
            }
    return out


def write_data_record(cfg: Any, out: Path) -> None:
    """Write the run's data_files.json (size and digest of each data file), or remove it if none."""
    files = data_files(cfg)
    path = out / DATA_RECORD
    if files:
        path.write_text(json.dumps({"format": 1, "files": files}, indent=1) + "\n")
    else:
        path.unlink(missing_ok=True)


def check_data_record(cfg: Any, out: Path) -> None:
    """ConfigError (a warning with ``trainer.allow_config_change``) when a recorded file is gone or
    changed; nothing to compare when the run has no record.
    """
    path = out / DATA_RECORD
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))["files"]
        assert isinstance(old, dict)
    except Exception:
        raise ConfigError(
            f"{str(path)!r} is garbled: what data the run read cannot be checked; restore it, "
            "or remove it to resume without the check"
        ) from None
    now = data_files(cfg)
    changed = []
    for key, rec in sorted(old.items()):
        cur = now.get(key)
        if cur is None:
            changed.append(f"{key}: {rec.get('path')!r} is gone")
        elif cur["path"] != rec.get("path"):
            changed.append(f"{key}: {rec.get('path')!r} -> {cur['path']!r}")
        elif cur["size"] != rec.get("size") or cur["sha256"] != rec.get("sha256"):
            changed.append(
                f"{key}: {cur['path']!r} changed since the run read it ({rec.get('size')} -> "
                f"{cur['size']} bytes, SHA-256 {str(rec.get('sha256'))[:12]} -> "
                f"{cur['sha256'][:12]})"
            )
    if not changed:
        return
    what = "; ".join(changed)
    if bool(cfg.trainer.allow_config_change):
        log.warning("resuming on other data (trainer.allow_config_change=true): %s", what)
        return
    raise ConfigError(
        f"resume=true on other data than the run read ({what}; recorded in {str(path)!r}): "
        "restore the file, or pass trainer.allow_config_change=true to continue on the new data"
    )
