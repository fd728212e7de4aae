"""The start decision: from the folder, its config, checkpoints and records, a run starts
fresh, resumes from a checkpoint, or is refused, and says why.

A resume trusts only what it can prove: the config and data record of the newest checkpoint
(its ``run_record.json``, checked against the checkpoint's ``checksums.json``), else the
folder's ``config.yaml`` / ``data_files.json``; a folder with checkpoints and neither is refused,
as is a resume that would rewind a finished run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from omegaconf import OmegaConf

from nemo_d3s.errors import ConfigError
from nemo_d3s.files import CHECKSUMS
from nemo_d3s.trainer.checkpoint import RUN_RECORD, checkpoint_dirs, step_of
from nemo_d3s.trainer.faults import first_line
from nemo_d3s.trainer.run_start.config_file import compare_config, read_run_config, refuse_records
from nemo_d3s.trainer.run_start.data_record import (
    DATA_RECORD,
    check_data_files,
    data_files,
    read_data_record,
)
from nemo_d3s.trainer.run_start.folder import RUN_CONFIG_KEYS, is_run_config, records

__all__ = [
    "StartDecision",
    "checkpoint_record",
    "decide",
    "read_checked_json",
    "run_record",
    "trusted_run_config",
]

log = logging.getLogger("nemo_d3s.trainer")

FRESH, AFRESH, RESUME = "fresh", "afresh", "resume"


@dataclass(frozen=True)
class StartDecision:
    """``kind``: ``"fresh"`` (step 0 in a new or reusable folder), ``"afresh"`` (``resume=true``
    without a checkpoint: earlier records go to ``previous-<n>/``, step 0) or ``"resume"`` (the
    newest of ``checkpoints`` that verifies); ``why`` in words; ``config_from``: where the
    resumed run's config was read (a checkpoint's run record or ``config.yaml``)."""

    kind: str
    why: str
    checkpoints: Tuple[str, ...] = ()
    config_from: Optional[str] = None


def run_record(cfg: Any) -> Dict[str, Any]:
    """What every checkpoint carries as ``run_record.json``: the resolved config the run trains
    with and its data files (``data_record.data_files``)."""
    return {
        "format": 1,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "data_files": data_files(cfg),
    }


def read_checked_json(ckpt: Path, name: str) -> Optional[Any]:
    """``ckpt/name`` parsed when ``checksums.json`` lists it with its SHA-256; None when the
    checkpoint has no such file (an older version's); ValueError saying what is wrong."""
    try:
        listed = json.loads((ckpt / CHECKSUMS).read_text(encoding="utf-8"))["files"]
    except Exception as e:
        raise ValueError(f"{CHECKSUMS} is missing or garbled ({first_line(e)})") from None
    entry = listed.get(name) if isinstance(listed, dict) else None
    if entry is None:
        if (ckpt / name).exists():
            raise ValueError(f"{name} is not covered by {CHECKSUMS}")
        return None
    try:
        data = (ckpt / name).read_bytes()
    except OSError as e:
        raise ValueError(f"{name} cannot be read ({e.strerror or e})") from None
    if not isinstance(entry, dict) or entry.get("sha256") != hashlib.sha256(data).hexdigest():
        raise ValueError(f"{name} does not match its SHA-256 checksum (corrupt)")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{name} is not JSON ({first_line(e)})") from None


def checkpoint_record(ckpt: Path) -> Optional[Dict[str, Any]]:
    """The checkpoint's run record ({"config", "data_files"}), None for a checkpoint written
    without one; ValueError when it is corrupt or of another shape."""
    rec = read_checked_json(ckpt, RUN_RECORD)
    if rec is None:
        return None
    if not (
        isinstance(rec, dict)
        and is_run_config(rec.get("config"))
        and isinstance(rec.get("data_files"), dict)
    ):
        raise ValueError(f"{RUN_RECORD} is not a run record")
    return rec


def _newest_record(out: Path) -> Tuple[Optional[Dict[str, Any]], Optional[Path]]:
    """The run record of the newest checkpoint that has a readable one, and that checkpoint;
    (None, None) when the newest complete checkpoint was written without one."""
    for ckpt in checkpoint_dirs(out / "checkpoints"):
        if not (ckpt / "trainer_state.json").is_file():
            continue  # incomplete: the load skips it too
        try:
            rec = checkpoint_record(ckpt)
        except ValueError as e:
            log.warning("%s: %s; looking at the next older checkpoint", ckpt, e)
            continue
        return (rec, ckpt) if rec is not None else (None, None)
    return None, None


def trusted_run_config(out: Path) -> Tuple[Optional[dict], Optional[str]]:
    """(the config the run in ``out`` trained with, where it was read): the newest checkpoint's
    run record, else ``config.yaml``; (None, None) for a folder without checkpoints whose
    ``config.yaml`` is absent or unreadable. A ConfigError names the file when the folder holds
    checkpoints but no config that can be trusted, or a ``config.yaml`` that is not a run's."""
    return _trusted(out, *_newest_record(out))


def _trusted(out: Path, rec: Optional[dict], ckpt: Optional[Path]) -> Tuple[Optional[dict], Any]:
    path = out / "config.yaml"
    old, why = read_run_config(out)
    # a mapping that shares no top-level key with a run's config is another program's file
    # (an emptied or cut-short one is the config check's business)
    foreign = bool(old) and not set(old) & set(RUN_CONFIG_KEYS)
    if rec is not None:
        if why is not None or foreign:
            log.warning(
                "%s %s; the run's config is read from %s",
                path,
                "is not a run's config" if foreign else f"cannot be read ({why})",
                ckpt,
            )
        return rec["config"], f"{str(ckpt / RUN_RECORD)!r}"
    if foreign:
        keys = ", ".join(map(str, list(old)[:4]))
        raise ConfigError(
            f"{str(path)!r} is not a run's config (a mapping of {keys}, without the run's "
            "output_dir, model, trainer and task): a file from elsewhere; put the run's "
            "config.yaml back, or choose another output_dir"
        )
    if old is not None:
        return old, f"{str(path)!r}"
    if not checkpoint_dirs(out / "checkpoints"):
        return None, None
    what = "is missing" if why is None else f"cannot be read ({why})"
    raise ConfigError(
        f"{str(path)!r} {what} and the checkpoints in {str(out / 'checkpoints')!r} carry no "
        "config of their own (written by an earlier version): what the run trained with "
        "cannot be known, and resuming with the default config would continue another "
        "experiment; restore the run's config.yaml"
    )


def _refuse_rewind(out: Path, newest: Path) -> None:
    """A finished run (``summary.json``) whose newest checkpoint is older than its end (a stop
    signal's checkpoint under ``save_every=0``) would be rewound by a resume: refused."""
    path = out / "summary.json"
    try:
        steps = json.loads(path.read_text(encoding="utf-8")).get("steps")
    except (OSError, ValueError, AttributeError):
        return  # absent or unreadable: the run did not finish (or it cannot be told)
    at = step_of(newest)
    if isinstance(steps, int) and steps > at:
        raise ConfigError(
            f"output_dir={str(out)!r} holds a finished run (summary.json: {steps} steps) "
            f"whose newest checkpoint is {newest.name}, from before its end (a stop signal's; "
            f"trainer.save_every=0 writes none at the end): resume=true would rewind it to step "
            f"{at} and train its last {steps - at} steps again over its records; the finished "
            "policy is in hf_export/; choose another output_dir to train further"
        )


def _check_data(cfg: Any, out: Path, now: dict, rec: Optional[dict], where: str) -> None:
    """The data files ``now`` against the checkpoint's record, else ``data_files.json``; a run
    that reads files without either record is refused (a warning with allow_config_change)."""
    allow = bool(cfg.trainer.allow_config_change)
    if rec is not None:
        check_data_files(rec["data_files"], now, where, allow)
        return
    recorded = read_data_record(out)
    if recorded is not None:
        check_data_files(recorded, now, f"{str(out / DATA_RECORD)!r}", allow)
        return
    if not now:
        return
    what = (
        f"{str(out / DATA_RECORD)!r} is missing and the checkpoints carry no data record: "
        "what data the run read cannot be checked"
    )
    if allow:
        log.warning("%s; continuing (trainer.allow_config_change=true)", what)
        return
    raise ConfigError(
        f"{what}; restore it, or pass trainer.allow_config_change=true to resume without the check"
    )


def decide(cfg: Any, out: Path, files: Optional[dict] = None) -> StartDecision:
    """Rank 0, before anything is changed: what this start does in ``out`` (ConfigError when
    it must not start there). Reads the folder only; ``files``: ``data_files(cfg)`` when known."""
    ckpts = checkpoint_dirs(out / "checkpoints")
    if not bool(cfg.resume):
        if ckpts:
            raise ConfigError(
                f"output_dir={str(out)!r} already holds checkpoints ({ckpts[0].name}); "
                "pass resume=true to continue that run or choose another output_dir"
            )
        refuse_records(out, cfg)
        return StartDecision(FRESH, "a new run")
    if not ckpts:
        found = records(out)
        return StartDecision(
            AFRESH,
            f"resume=true but output_dir={str(out)} holds no checkpoint (nothing in "
            f"{out / 'checkpoints'}): this is a fresh run from step 0, not a continuation"
            + (f"; the earlier run's {', '.join(found)} move to previous-<n>/" if found else ""),
        )
    _refuse_rewind(out, ckpts[0])
    rec, ckpt = _newest_record(out)
    base, where = _trusted(out, rec, ckpt)
    compare_config(cfg, base, where)
    now = data_files(cfg) if files is None else files
    _check_data(cfg, out, now, rec, f"{str(ckpt / RUN_RECORD)!r}" if ckpt else "")
    return StartDecision(
        RESUME,
        f"resume=true: continuing from the newest checkpoint that verifies ({ckpts[0].name} "
        f"first), with the config of {where}",
        tuple(p.name for p in ckpts),
        where,
    )
