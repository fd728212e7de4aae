"""Atomic, checksummed checkpoints of the whole run state, the last N kept.

``DIR/checkpoints/step_XXXXXX/`` holds ``backend.pt`` (rank 0; or the backend's own sharded
files), ``rng_rank{r}.pt`` (generator states as tensors), ``trainer_state.json``,
``run_record.json`` (the config the run trained with and the data files it read) and
``checksums.json`` (size + SHA-256 of every other file, written last). Each rank hashes what it
wrote and verifies ~1/world of the bytes; the findings are all-gathered, so every rank loads the
same checkpoint or raises the same RunError (waits: ``trainer.dist_timeout_minutes``). Loads
use ``weights_only=True``. Written into ``.tmp_step_XXXXXX`` and renamed by rank 0, so a killed
save never looks complete. Data order needs no saved state.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from nemo_d3s.backends.base import Policy
from nemo_d3s.core.checks import is_count, is_number
from nemo_d3s.distributed.agree import all_gather_texts
from nemo_d3s.distributed.groups import ParallelGroups
from nemo_d3s.files import (
    CHECKSUMS,
    file_digests,
    fsync_folder,
    fsync_path,
    fsync_tree,
    looks_like_write_failure,
    space_note,
    write_checksums,
)
from nemo_d3s.formats.checksums import Gather, verify_checksums
from nemo_d3s.trainer.faults import RunError, broadcast_world, fault_point, first_line
from nemo_d3s.trainer.rng_state import capture_rng, restore_rng, safe_load

__all__ = [
    "CHECKSUMS",
    "RUN_RECORD",
    "TrainerState",
    "CheckpointManager",
    "latest_checkpoint",
    "checkpoint_dirs",
    "step_of",
    "verify_checkpoint",
    "safe_load",
    "looks_like_write_failure",  # files', re-exported (with space_note) for the entry point
    "space_note",
    "capture_rng",
    "restore_rng",
]

log = logging.getLogger("nemo_d3s.trainer")

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
RUN_RECORD = "run_record.json"


@dataclass
class TrainerState:
    """Counters carried across steps (and checkpoints)."""

    step: int = 0  # optimizer-loop steps completed
    update_tokens_total: float = 0.0
    rollout_tokens_total: float = 0.0
    skipped_steps: int = 0
    reward_errors_total: int = 0
    wall_time_total: float = 0.0  # summed over run segments (resumes)
    extra: Dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ finding and verifying
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_dirs(ckpt_root: str | os.PathLike) -> List[Path]:
    """Every ``step_*`` directory under ``ckpt_root``, newest (highest step) first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def step_of(path: Path) -> int:
    """The step of a ``step_*`` directory (its name)."""
    return int(_STEP_DIR.match(path.name).group(1))


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Optional[Path]:
    """The checkpoint with the highest step that has its ``trainer_state.json``, or None
    (not verified: see :func:`verify_checkpoint`)."""
    for p in checkpoint_dirs(ckpt_root):
        if (p / "trainer_state.json").is_file():
            return p
    return None


def _read_state(path: Path) -> TrainerState:
    raw = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    state = TrainerState(**raw)  # an unknown key: TypeError
    for name, ok in _STATE_CHECKS.items():
        if not ok(getattr(state, name)):
            raise ValueError(f"{name}={getattr(state, name)!r}")
    return state


# what each TrainerState field must be when read back (a number where a float is kept)
_STATE_CHECKS: Dict[str, Callable[[Any], bool]] = {
    "step": is_count,
    "update_tokens_total": is_number,
    "rollout_tokens_total": is_number,
    "skipped_steps": is_count,
    "reward_errors_total": is_count,
    "wall_time_total": is_number,
    "extra": lambda v: isinstance(v, dict),
}


def job_world() -> Tuple[int, int, Optional[Gather]]:
    """(rank, world size, all-gather of texts over the world) of this process's job."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0, 1, None
    return (
        dist.get_rank(),
        dist.get_world_size(),
        lambda text: all_gather_texts(text, dist.group.WORLD),
    )


def _structure(path: Path) -> Optional[str]:
    """What makes ``path`` no checkpoint before any file is hashed, or None."""
    if not (path / "trainer_state.json").is_file():
        return "no trainer_state.json (empty or incomplete)"
    try:
        _read_state(path)
    except Exception as e:
        return f"trainer_state.json is garbled ({first_line(e)})"
    if not (path / CHECKSUMS).is_file():
        return f"no {CHECKSUMS} (incomplete, or written by a version without checksums)"
    try:
        covered = (
            "trainer_state.json"
            in json.loads((path / CHECKSUMS).read_text(encoding="utf-8"))["files"]
        )
    except Exception as e:
        return f"{CHECKSUMS} is garbled ({first_line(e)})"
    if not covered:
        return f"{CHECKSUMS} does not cover trainer_state.json"
    return None


def verify_checkpoint(path: Path, *, shared: bool = False) -> Optional[str]:
    """None when ``path`` is a complete checkpoint matching ``checksums.json``, else what is wrong.
    ``shared``: collective over the job (each rank hashes its share, same answer everywhere).
    """
    rank, world, gather = job_world() if shared else (0, 1, None)
    return verify_checksums(path, rank=rank, world=world, gather=gather, found=_structure(path))


def _shape_mismatches(current: Any, loaded: Any, prefix: str = "") -> List[str]:
    """Paths where both state trees hold a tensor and the shapes differ."""
    if isinstance(current, torch.Tensor) and isinstance(loaded, torch.Tensor):
        if current.shape != loaded.shape:
            return [f"{prefix}: checkpoint {list(loaded.shape)} vs model {list(current.shape)}"]
        return []
    out: List[str] = []
    if isinstance(current, dict) and isinstance(loaded, dict):
        for k in current:
            if k in loaded:
                out += _shape_mismatches(
                    current[k], loaded[k], f"{prefix}.{k}" if prefix else str(k)
                )
    elif (
        isinstance(current, (list, tuple))
        and isinstance(loaded, (list, tuple))
        and len(current) == len(loaded)
    ):
        for i, (a, b) in enumerate(zip(current, loaded)):
            out += _shape_mismatches(a, b, f"{prefix}[{i}]")
    return out


def _write_failure(what: str, root: Path, e: BaseException) -> RunError:
    return RunError(
        f"could not write {what} under {str(root)!r}: {first_line(e)} ({space_note(root)}); "
        "earlier checkpoints are untouched, resume=true continues from the last one"
    )


def export_failure(folder: Path, e: BaseException) -> str:
    """The one line for a failed write of the run's HF export (the run itself finished)."""
    return (
        f"could not write the Hugging Face export {str(folder)!r}: {first_line(e)} "
        f"({space_note(folder.parent)}); the run finished and its last checkpoint and "
        "summary.json are written: free some space and run again with resume=true to "
        "write the export"
    )


class CheckpointManager:
    """The run's checkpoints: collective save, keep-last pruning, the latest to resume from."""

    def __init__(
        self,
        output_dir: str,
        dp: ParallelGroups,
        keep_last: int,
        record: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.dp = dp
        self.keep_last = keep_last
        self.record = record  # rank 0 writes it into every checkpoint as RUN_RECORD

    def save(
        self,
        backend: Policy,
        state: TrainerState,
        extra_files: Optional[Callable[[Path], List[str]]] = None,
    ) -> Path:
        """Collective: every rank calls it. Returns the final directory. ``extra_files(folder)``
        writes this rank's further files and returns their names, hashed with the rest."""
        final = self.root / step_dir_name(state.step)
        tmp = self.root / f".tmp_{step_dir_name(state.step)}"
        _, _, gather = job_world()
        mine: Any = None
        try:
            if self.dp.is_main:
                if tmp.exists():
                    shutil.rmtree(tmp)  # left over from a run killed while saving
                tmp.mkdir(parents=True)
        except Exception as e:
            mine = e
        # Rank 0's folder (or why it has none) reaches every rank before any writes into it:
        # a barrier rank 0 skipped after a failure would have met the other ranks' gather.
        made = broadcast_world(None if mine is None else first_line(mine))
        if made is not None and mine is None:
            mine = OSError(f"rank 0 could not create {tmp}: {made}")
        if mine is None:
            try:
                fault_point("checkpoint.tmp_created")
                mine = self._write_own(backend, state, tmp, extra_files)
            except Exception as e:
                mine = e
        # every rank's digests (or its failure), gathered: the wait for the slowest writer
        texts = [json.dumps({"error": first_line(mine)} if isinstance(mine, Exception) else mine)]
        texts = gather(texts[0]) if gather is not None else texts
        reports = [json.loads(t) for t in texts]
        failed = [(r, x["error"]) for r, x in enumerate(reports) if "error" in x]
        try:
            if isinstance(mine, Exception):
                raise mine
            if failed:
                r, why = failed[0]
                raise OSError(f"rank {r} could not write its files: {why}")
            if self.dp.is_main:
                merged: Dict[str, Any] = {}
                for x in reports:
                    merged.update(x["digests"])
                write_checksums(tmp, merged)  # last: covers every file; hashes unnamed ones
                fault_point("checkpoint.before_rename")
                # Flushed before the rename publishes it, as files.atomic_folder does: a
                # crash cannot leave a complete-looking checkpoint with unwritten files (the
                # files the ranks named, each flushed by its writer in _write_own, not again)
                fsync_tree(tmp, flushed=merged)
                if final.exists():  # a step saved again: its old copy goes aside first
                    # (atomic) and _prune deletes it: a kill -9 inside a deletion must not
                    # leave a half-deleted step_* that looks like a checkpoint
                    aside = self.root / f".pruned_{final.name}"
                    if aside.exists():
                        shutil.rmtree(aside)
                    os.replace(final, aside)
                os.replace(tmp, final)
                fsync_folder(self.root)
                fault_point("checkpoint.renamed")
                self._prune(state.step)
        except Exception as e:
            if not looks_like_write_failure(e):
                raise
            if self.dp.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _write_failure(f"checkpoint {final.name}", self.root, e) from None
        self.dp.barrier()
        return final

    def _write_own(
        self, backend: Policy, state: TrainerState, tmp: Path, extra_files=None
    ) -> Dict[str, Any]:
        """This rank's files of the checkpoint in ``tmp``, hashed right after writing:
        {"digests": {relative path: {"size", "sha256"}}}."""
        wrote = backend.save_checkpoint(str(tmp))
        mine = [str(f) for f in wrote] if isinstance(wrote, (list, tuple)) else []
        if wrote is False and self.dp.is_main:
            torch.save(backend.state_dict(), tmp / "backend.pt")
            mine.append("backend.pt")
        fault_point("checkpoint.backend_written")
        if extra_files is not None:
            mine += [str(f) for f in extra_files(tmp)]
        rng = f"rng_rank{self.dp.global_rank}.pt"
        torch.save(capture_rng(), tmp / rng)
        mine.append(rng)
        if self.dp.is_main:
            (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1))
            mine.append("trainer_state.json")
            if self.record is not None:
                (tmp / RUN_RECORD).write_text(json.dumps(self.record, indent=1))
                mine.append(RUN_RECORD)
        # Each rank flushes what it wrote: on a parallel filesystem rank 0's fsync_tree does
        # not reach the dirty pages of another node's client, and the rename publishes them.
        for rel in mine:
            fsync_path(str(tmp / rel), folder=False)
        for folder in {(tmp / rel).parent for rel in mine}:
            fsync_path(str(folder), folder=True)
        return {"digests": file_digests(tmp, mine)}

    def _prune(self, step: int) -> None:
        # A step_* past the one just saved is of a rewound history: the resume found it
        # unusable and fell back. It goes, and the newest keep_last of the rest stay;
        # counting it among them would delete the good ones it stands in front of.
        # Renamed out of the step_* names first (atomic): a kill -9 inside rmtree must not
        # leave a half-deleted step_* directory that a resume would try to load.
        dirs = checkpoint_dirs(self.root)
        later = [p for p in dirs if step_of(p) > step]
        for p in later + [p for p in dirs if p not in later][self.keep_last :]:
            os.replace(p, self.root / f".pruned_{p.name}")
        for p in self.root.glob(".pruned_step_*"):  # this prune's and a killed one's
            shutil.rmtree(p, ignore_errors=True)

    def _recover_resave(self) -> None:
        """A step saved again moves its old copy aside, then renames the new one in: a kill
        between the two renames leaves ``.pruned_step_N`` and ``.tmp_step_N`` and no
        ``step_N``. The new copy goes in if it was complete (its checksums are written last),
        else the old one goes back; the load verifies either."""
        for tmp in self.root.glob(".tmp_step_*"):
            final = self.root / tmp.name[len(".tmp_") :]
            aside = self.root / f".pruned_{final.name}"
            if final.exists() or not aside.is_dir() or not _STEP_DIR.match(final.name):
                continue
            back = tmp if (tmp / CHECKSUMS).is_file() else aside
            os.replace(back, final)
            fsync_folder(self.root)
            log.warning("%s was cut short between its renames: %s restored", final.name, back.name)

    def load_latest(self, backend: Policy) -> Optional[Tuple[Path, TrainerState]]:
        """Restore the newest checkpoint that verifies (older ones after a warning); None when
        there is no ``step_*`` directory. Collective: rank 0's list is broadcast, every rank
        verifies its share, then all load the agreed checkpoint.
        """
        if self.dp.is_main:
            self._recover_resave()
        names = broadcast_world(
            [p.name for p in checkpoint_dirs(self.root)] if self.dp.is_main else None
        )
        chosen, problems = None, []
        for name in names:
            why = verify_checkpoint(self.root / name, shared=True)
            if why is None:
                chosen = self.root / name
                break
            problems.append(f"{name}: {why}")
            if self.dp.is_main:
                log.warning("checkpoint %s is unusable: %s; trying the next older one", name, why)
        if chosen is None:
            if not problems:
                return None
            raise RunError(
                f"no usable checkpoint in {str(self.root)!r}: "
                + "; ".join(problems)
                + ". Remove the bad ones (or the folder) to start over"
            )
        if problems and self.dp.is_main:
            log.warning(
                "resuming from %s instead of the newest checkpoint (%s)",
                chosen.name,
                "; ".join(problems),
            )
        return chosen, self.load(chosen, backend)

    def load(self, path: Path, backend: Policy) -> TrainerState:
        """Restore backend, this rank's RNG streams and the trainer counters from ``path``
        (checked by :func:`verify_checkpoint` first by :meth:`load_latest`)."""
        state = _read_state(path)
        try:
            if not backend.load_checkpoint(str(path)):
                loaded = safe_load(path / "backend.pt")
                bad = _shape_mismatches(backend.state_dict(), loaded)
                if bad:
                    raise RunError(
                        f"checkpoint {str(path)!r} was written for a different model: "
                        f"{len(bad)} tensors differ in shape (first: {bad[0]}); resume "
                        "with the model settings of that run"
                    )
                backend.load_state_dict(loaded)
        except RunError:
            raise
        except Exception as e:  # (checksums match: a foreign or crafted file, no traceback)
            raise RunError(
                f"checkpoint {str(path)!r} does not fit this model/optimizer: {first_line(e)}"
            ) from None
        rng_file = path / f"rng_rank{self.dp.global_rank}.pt"
        if rng_file.is_file():
            try:
                restore_rng(safe_load(rng_file))
            except Exception as e:  # wrong types, sizes or keys of a generator state
                raise RunError(f"{str(rng_file)!r}: {first_line(e)}") from None
        else:
            log.warning(
                "%s missing (different number of ranks?); RNG streams not restored", rng_file.name
            )
        return state
