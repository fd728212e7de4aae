"""The run's start, decided in one place: from the output folder, its config, checkpoints and
records, a run starts fresh, resumes, or is refused, and says why.

Public API (what the loop and a generation pipeline use)::

    cfg = resolve_config(cfg, overrides, out, compose_neutral, conf)  # resume=true: the run's
                                                                      # own config + overrides
    start = RunStart(cfg, groups, ckpt)  # ckpt: CheckpointManager (gets the run record)
    start.take()                         # collective: folder usable and locked
    state = start.begin(policy)          # collective: decide + act; state.step to train from
    start.decision                       # StartDecision: kind ("fresh" | "afresh" | "resume"),
                                         # why, checkpoints, config_from
    start.resumed_from                   # the checkpoint loaded (None: step 0)
    start.release()                      # at the run's end

``decide(cfg, out)`` is the decision alone (rank 0, reads only); ``trusted_run_config(out)`` the
config a resume trusts. Modules: ``folder`` (usable folder, lock, earlier records),
``config_file`` (``config.yaml``), ``config_merge`` (the resumed config), ``data_record``
(``data_files.json``), ``decision``, ``start``.
"""

from __future__ import annotations

import importlib

# name -> its module: imported when first used (the CLI's output_dir check runs before torch)
_HOMES = {
    "RunStart": "start",
    "StartDecision": "decision",
    "agree_on_config": "config_merge",
    "check_output_dir": "folder",
    "decide": "decision",
    "resolve_config": "config_merge",
    "trusted_run_config": "decision",
}
__all__ = [
    "RunStart",
    "StartDecision",
    "agree_on_config",
    "check_output_dir",
    "decide",
    "resolve_config",
    "trusted_run_config",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(name)
    module = importlib.import_module(f"nemo_d3s.trainer.run_start.{_HOMES[name]}")
    return getattr(module, name)
