"""The GRPO / D3S training loop, backend-agnostic, and the run around it (run folder, checkpoints,
resume, records, metrics, evaluation). ``Trainer``, ``train`` and ``run_step`` are imported
lazily: the ``nemo-d3s-plot`` command should not pay for torch.distributed / transformers.
"""

from __future__ import annotations

__all__ = ["Trainer", "train", "run_step"]


def __getattr__(name: str):
    if name in ("Trainer", "train"):
        from nemo_d3s.trainer import loop

        return getattr(loop, name)
    if name == "run_step":
        from nemo_d3s.trainer.step import run_step

        return run_step
    raise AttributeError(name)
