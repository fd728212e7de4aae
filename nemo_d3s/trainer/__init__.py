"""The GRPO / D3S training loop, backend-agnostic.

Modules: ``step`` (one training step, on one screen), ``update`` (compaction, loss closure,
mini-batches), ``loop`` (the run: the step loop, evaluation, checkpoints, export),
``records`` (running totals, the reward checks, summary.json, interrupted.json),
``signals`` (stop signals), ``resume`` (what a fresh or resumed run checks in its directory;
config.yaml), ``rundir``, ``data`` (prompts and per-prompt seeds), ``checkpoint``,
``metrics``, ``stats``, ``evaluate``, ``prompt_check`` (prompt lengths against the model's
context), ``tasks_adapter`` (the task behind the loop), ``faults`` (errors, fault points,
agreement across ranks), ``build`` (config -> objects), ``backend_registry``, ``plot`` (the
``nemo-d3s-plot`` command).

``from nemo_d3s.trainer import Trainer, train`` (imported lazily: the plot command should
not pay for torch.distributed / transformers imports).
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
