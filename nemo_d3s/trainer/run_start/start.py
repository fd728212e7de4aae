"""The run's start in its folder, as the loop runs it: take the folder, decide (``decision.py``),
then act on the decision on every rank and write the run's records.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from nemo_d3s.trainer.checkpoint import CheckpointManager, TrainerState
from nemo_d3s.trainer.faults import RunError, agree_on_main, broadcast_world
from nemo_d3s.trainer.metrics import truncate_jsonl
from nemo_d3s.trainer.records import INTERRUPTED_MARKER
from nemo_d3s.trainer.run_start.config_file import compare_config, move_records_aside, write_config
from nemo_d3s.trainer.run_start.data_record import DATA_RECORD, write_data_record
from nemo_d3s.trainer.run_start.decision import (
    AFRESH,
    RESUME,
    StartDecision,
    checkpoint_record,
    decide,
    run_record,
)
from nemo_d3s.trainer.run_start.folder import RunDirLock, check_output_dir

__all__ = ["RunStart"]

log = logging.getLogger("nemo_d3s.trainer")

_RECORDS = ("metrics.jsonl", "eval.jsonl")


class RunStart:
    """One run's start in ``cfg.output_dir``; collective calls in this order: :meth:`take` (the
    folder checked and locked by global rank 0), :meth:`begin` (decided, then acted on: the
    state to train from), :meth:`release` (the lock, at the run's end). ``ckpt`` saves the run
    record (:func:`decision.run_record`) into every checkpoint from here on."""

    def __init__(self, cfg: Any, groups: Any, ckpt: CheckpointManager) -> None:
        self.cfg, self.groups, self.ckpt = cfg, groups, ckpt
        self.out = Path(cfg.output_dir)
        self.decision: Optional[StartDecision] = None
        self.resumed_from: Optional[Path] = None  # the checkpoint loaded, when resumed
        self._lock: Optional[RunDirLock] = None
        # the config and data digests, taken once (rank 0 writes them into every checkpoint)
        self.record = ckpt.record = run_record(cfg) if groups.is_main else None

    def take(self) -> None:
        """The folder usable and this run's alone (one run per folder, for the whole run)."""
        agree_on_main(self.groups, self._take)

    def _take(self) -> None:
        check_output_dir(str(self.out))
        self._lock = RunDirLock(self.out).acquire()

    def release(self) -> None:
        """Drop the folder's lock (rank 0; a no-op elsewhere or when never taken)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def begin(self, policy: Any) -> TrainerState:
        """Decide, then act on every rank: a fresh state (earlier records refused or moved
        aside), or the checkpoint's (the policy loaded, records cut back to its step); then
        ``config.yaml`` and the data record written and an earlier ``interrupted.json`` removed."""
        files = self.record["data_files"] if self.record else None
        d = agree_on_main(self.groups, lambda: decide(self.cfg, self.out, files))
        self.decision = d = StartDecision(*broadcast_world(None if d is None else _plain(d)))
        state = TrainerState()
        if d.kind == AFRESH:
            agree_on_main(self.groups, lambda: move_records_aside(self.out))
            # Not an error: the sbatch scripts pass resume=true on a job's first start too.
            log.warning(d.why)
        elif d.kind == RESUME:
            state = self._load(policy)
        if self.groups.is_main:
            for name in _RECORDS:  # fresh: empty files (records were refused or moved aside)
                keep = state.step if d.kind == RESUME else -1
                if name == "eval.jsonl" and state.extra.get("pending_eval") == state.step:
                    keep -= 1  # the loop evaluates this step again: its earlier row goes
                truncate_jsonl(self.out / name, keep)
            write_config(self.cfg, self.out, resumed=d.kind == RESUME)
            if d.kind != RESUME or not (self.out / DATA_RECORD).is_file():
                write_data_record(files, self.out)
            (self.out / INTERRUPTED_MARKER).unlink(missing_ok=True)  # an earlier segment's
        self.groups.barrier()
        return state

    def _load(self, policy: Any) -> TrainerState:
        loaded = self.ckpt.load_latest(policy)
        if loaded is None:
            raise RunError(f"the checkpoints in {str(self.ckpt.root)!r} are gone")
        self.resumed_from, state = loaded
        agree_on_main(self.groups, self._check_loaded)
        log.info("resumed from %s (step %d)", self.resumed_from, state.step)
        return state

    def _check_loaded(self) -> None:
        """An older checkpoint than the one the config came from (the newer did not verify)
        must carry the same experiment."""
        try:
            rec = checkpoint_record(self.resumed_from)
        except ValueError as e:
            raise RunError(f"{str(self.resumed_from)!r}: {e}") from None
        where = f"{str(self.resumed_from / 'run_record.json')!r}"
        if rec is not None and where != self.decision.config_from:
            compare_config(self.cfg, rec["config"], where)


def _plain(d: StartDecision) -> tuple:
    return (d.kind, d.why, d.checkpoints, d.config_from)
