"""``python -m nemo_d3s.train`` / ``nemo-d3s-train``: the Hydra entry point of training.

Examples::

    python -m nemo_d3s.train                                  # SmolLM2-135M, D3S, CPU
    python -m nemo_d3s.train experiment=smoke output_dir=/tmp/smoke
    python -m nemo_d3s.train d3s=pods algorithm=gspo trainer.steps=50
    python -m nemo_d3s.train -m d3s=grpo,d3s                  # a sweep (multirun)
    python -m nemo_d3s.train --cfg job                        # print the composed config
    torchrun --nproc_per_node=2 -m nemo_d3s.train experiment=smoke output_dir=/tmp/dp2

Where the config lives: the ``conf/`` folder at the repository root, found relative to
this file (``<repo>/nemo_d3s/train.py`` -> ``<repo>/conf``), which is where it is for a
source checkout and an editable install (``pip install -e .``). ``$NEMO_D3S_CONF_DIR``
overrides it; ``nemo_d3s/conf`` (inside the package) is the fallback for a wheel that
ships the YAML files as package data.

Output directory: ``output_dir`` (default ``outputs/<date>_<time>``). Hydra does not
chdir (``hydra.job.chdir=false``) and writes its own ``.hydra/`` into the same folder. In
a multirun sweep every job writes to Hydra's job folder (``multirun/<date>_<time>/<job
number>``, set ``hydra.sweep.dir`` to move it) unless the sweep sets ``output_dir`` itself,
e.g. ``-m d3s=grpo,d3s output_dir=runs/${d3s.preset}`` (quote it in a shell).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

__all__ = ["main", "conf_dir"]

log = logging.getLogger("nemo_d3s.train")


def conf_dir() -> Path:
    """The Hydra config folder: $NEMO_D3S_CONF_DIR, <repo>/conf, or <package>/conf."""
    env = os.environ.get("NEMO_D3S_CONF_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here.parent / "conf", here / "conf"]
    for c in candidates:
        if (c / "config.yaml").is_file():
            return c
    raise FileNotFoundError(
        "cannot find the Hydra config folder (conf/config.yaml); looked in "
        + ", ".join(str(c) for c in candidates)
        + ". Install from a source checkout (pip install -e .) or set NEMO_D3S_CONF_DIR."
    )


def _job_output_dir(cfg) -> str:
    """``output_dir``, except in a sweep that does not set it: there each job writes to
    Hydra's job folder (a sweep that sets it, e.g. ``output_dir=runs/${d3s.preset}``, is
    responsible for making it differ between jobs)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
    except ValueError:
        return str(cfg.output_dir)
    user_set = any(o.split("=", 1)[0].lstrip("+~") == "output_dir" for o in hc.overrides.task)
    if hc.mode == RunMode.MULTIRUN and not user_set:
        return str(hc.runtime.output_dir)
    return str(cfg.output_dir)


def _run(cfg) -> None:
    from omegaconf import OmegaConf, open_dict

    from nemo_d3s.config import ConfigError
    from nemo_d3s.trainer.loop import train

    out = _job_output_dir(cfg)
    with open_dict(cfg):
        cfg.output_dir = out
    OmegaConf.resolve(cfg)
    try:
        state = train(cfg)
    except (ConfigError, FileNotFoundError) as e:
        # A user mistake, not a bug: one clear line, no traceback.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if state.extra.get("interrupted"):
        log.info("stopped early at step %d; resume with resume=true", state.step)


def main() -> None:
    import hydra

    from nemo_d3s.config import register_configs

    register_configs()
    # hydra.main parses sys.argv itself (--cfg job, -m, overrides).
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_run)()


if __name__ == "__main__":
    main()
