"""Atomic checkpoints of the whole run state, the last N kept.

Layout of ``DIR/checkpoints/step_XXXXXX/`` (XXXXXX = optimizer-loop steps completed)::

    backend.pt          model + optimizer (+ LR scheduler) from ``backend.state_dict()``
                        (rank 0; a backend with ``save_checkpoint(dir)`` writes its own files
                        from every rank instead, e.g. sharded Megatron state)
    trainer_state.json  step, cumulative counters
    rng_rank{r}.pt      python ``random``, numpy, torch (+ CUDA) generator states of global rank r

Atomicity (why): a run killed mid-save must never leave a directory that looks complete.
Everything is written into ``.tmp_step_XXXXXX`` and renamed into place by rank 0 after a
barrier; ``latest_checkpoint`` ignores temp directories. Older ``step_*`` beyond
``keep_last`` are deleted after the rename.

Data order needs no saved state: prompts and generation seeds are pure functions of
(seed, step) (see ``trainer.data``), and so is the (N, K) schedule position.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from nemo_d3s.backends.base import Policy
from nemo_d3s.distributed.groups import ParallelGroups

__all__ = ["TrainerState", "CheckpointManager", "latest_checkpoint", "capture_rng", "restore_rng"]

log = logging.getLogger("nemo_d3s.trainer")

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


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


def capture_rng() -> Dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Optional[Path]:
    """The complete checkpoint with the highest step, or None."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "trainer_state.json").is_file():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


class CheckpointManager:
    def __init__(self, output_dir: str, dp: ParallelGroups, keep_last: int) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.dp = dp
        self.keep_last = keep_last

    def save(self, backend: Policy, state: TrainerState) -> Path:
        """Collective: every rank calls it. Returns the final directory."""
        final = self.root / step_dir_name(state.step)
        tmp = self.root / f".tmp_{step_dir_name(state.step)}"
        if self.dp.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)  # left over from a run killed while saving
            tmp.mkdir(parents=True)
        self.dp.barrier()
        own = getattr(backend, "save_checkpoint", None)
        if callable(own):
            own(str(tmp))
        elif self.dp.is_main:
            torch.save(backend.state_dict(), tmp / "backend.pt")
        torch.save(capture_rng(), tmp / f"rng_rank{self.dp.global_rank}.pt")
        self.dp.barrier()
        if self.dp.is_main:
            # trainer_state.json is what marks a directory complete; written last.
            (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        self.dp.barrier()
        return final

    def _prune(self) -> None:
        steps = sorted(
            (int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        )
        for _, p in steps[: max(0, len(steps) - self.keep_last)]:
            shutil.rmtree(p, ignore_errors=True)

    def load(self, path: Path, backend: Policy) -> TrainerState:
        """Restore backend, this rank's RNG streams and the trainer counters from ``path``."""
        own = getattr(backend, "load_checkpoint", None)
        if callable(own):
            own(str(path))
        else:
            backend.load_state_dict(torch.load(path / "backend.pt", map_location="cpu", weights_only=False))
        rng_file = path / f"rng_rank{self.dp.global_rank}.pt"
        if rng_file.is_file():
            restore_rng(torch.load(rng_file, weights_only=False))
        else:
            log.warning("%s missing (different number of ranks?); RNG streams not restored", rng_file.name)
        raw = json.loads((path / "trainer_state.json").read_text())
        return TrainerState(**raw)
