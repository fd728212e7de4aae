"""What the dry run plans for: the job's shape, the model folder, and :class:`Setup`, the
checked layout ``plan.py`` builds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from nemo_d3s.core.checks import is_count
from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.spec import ModelSpec

__all__ = ["JobShape", "Setup", "job_shape", "model_folder"]


@dataclass(frozen=True)
class JobShape:
    """Nodes x GPUs per node of the job the dry run sizes, and where those numbers came from."""

    nodes: int
    gpus_per_node: int
    source: str  # where the numbers came from, for messages

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def job_shape(
    env: Optional[Mapping[str, str]] = None,
    nodes: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
) -> JobShape:
    """Nodes x GPUs per node: ``NNODES`` / ``GPUS_PER_NODE``, else ``SLURM_JOB_NUM_NODES`` /
    ``SLURM_GPUS_ON_NODE``, else ``nodes`` / ``gpus_per_node`` (the recipe's), else 1 x 8.
    """
    env = os.environ if env is None else env

    def pick(*names: str, default: int) -> Tuple[int, str]:
        key = {
            "NNODES": ("trainer.nodes", nodes),
            "GPUS_PER_NODE": ("trainer.gpus_per_node", gpus_per_node),
        }
        recipe_key, recipe = key[names[0]]
        for n in names:
            v = env.get(n)
            if v not in (None, ""):
                try:
                    x = int(v)
                except ValueError:
                    x = 0
                if x < 1:
                    raise ConfigError(f"{n}={v!r}: must be a positive integer")
                return x, f"{n}={x}"
        if recipe is not None:
            if not is_count(recipe, 1):
                raise ConfigError(f"{recipe_key}={recipe!r}: must be a positive integer")
            return recipe, f"{recipe_key}={recipe}"
        return default, f"{names[0]}={default} (default)"

    nodes, a = pick("NNODES", "SLURM_JOB_NUM_NODES", default=1)
    gpus, b = pick("GPUS_PER_NODE", "SLURM_GPUS_ON_NODE", default=8)
    return JobShape(nodes, gpus, f"{a} x {b}")


def model_folder(name: str) -> Path:
    """``model.name`` as a folder: as given, else relative to the folder holding ``nemo_d3s`` (the
    shipped ``nemo_d3s/recipes/<name>``), else the backend's own resolution (short names).
    """
    p = Path(name).expanduser()
    if p.is_dir():
        return p.resolve()
    packaged = Path(__file__).resolve().parents[2] / name
    if not p.is_absolute() and packaged.is_dir():
        return packaged
    from nemo_d3s.backends.hf.loading import resolve_model_path

    return Path(resolve_model_path(name)).resolve()


@dataclass(frozen=True)
class Setup:
    """What the run config and the job's shape ask for, checked."""

    cfg: Any
    mcfg: Any  # the backend's typed config (MegatronBackendConfig)
    spec: ModelSpec
    folder: Path
    shape: JobShape
    gpu: float  # bytes of one GPU
    tp: int
    pp: int
    dp: int
    order: str  # Megatron's rank order
    vocab: int  # the padded vocabulary
    engine: str  # rollout.engine
    vllm_tp: int
    nvls: bool = True  # NCCL uses NVLink SHARP (NCCL_NVLS_ENABLE is not 0)
