"""What the dry run plans for: the job's shape, the model folder, and :class:`Setup`, the
checked layout ``plan.py`` plans (:func:`checked_setup`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from nemo_d3s.backends.megatron.parallel import rank_order
from nemo_d3s.core.checks import is_count, is_real
from nemo_d3s.dry_run.memory import GB
from nemo_d3s.dry_run.moe import check_planned_moe
from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.spec import ModelSpec, check_layout, padded_vocab_size

__all__ = ["JobShape", "Setup", "checked_setup", "job_shape", "model_folder"]


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
    generation_gpus: int = 0  # rollout.generation_gpus: the engines' GPUs apart (0: colocated)
    cp: int = 1  # model.params.context_parallel_size
    ep: int = 1  # expert parallelism (mixture of experts)
    etp: int = 1  # expert tensor parallelism
    nvls: bool = True  # NCCL uses NVLink SHARP (NCCL_NVLS_ENABLE is not 0)

    @property
    def engines_per_copy(self) -> int:
        """Rollout engines per TP x PP group (``model.params.rollout_engines_per_copy``)."""
        return int(getattr(self.mcfg, "rollout_engines_per_copy", 1))


def checked_setup(cfg: Any, shape: JobShape) -> Setup:
    """Validate the run config, translate it to the backend's config (the trainer's own
    path) and check every divisibility rule of the layout on the job's world size."""
    from nemo_d3s.config import validate, validate_layout
    from nemo_d3s.trainer.build import checked_backend_config

    validate(cfg)
    logging.getLogger("megatron").setLevel(
        logging.WARNING
    )  # its import-time notices are not the plan
    if str(cfg.model.backend) != "megatron":
        raise ConfigError(
            f"model.backend={cfg.model.backend!r}: trainer.dry_run plans Megatron layouts; use "
            "model=megatron (slurm/README.md says which models fit the HF backend)"
        )
    gpu_gb = cfg.trainer.gpu_memory_gb
    if not (is_real(gpu_gb) and gpu_gb > 0):
        raise ConfigError(f"trainer.gpu_memory_gb={gpu_gb!r}: must be > 0 (GB of one GPU)")
    mcfg = checked_backend_config(cfg)
    folder = model_folder(str(cfg.model.name))
    spec = ModelSpec.from_folder(folder)
    tp, pp = int(mcfg.tensor_model_parallel_size), int(mcfg.pipeline_model_parallel_size)
    vpp = int(mcfg.virtual_pipeline_model_parallel_size or 1)
    ep = int(mcfg.expert_model_parallel_size)
    etp = int(mcfg.expert_tensor_parallel_size or tp)
    cp = int(mcfg.context_parallel_size)
    try:
        dp = check_layout(
            spec,
            tp=tp,
            pp=pp,
            world=shape.world,
            vpp=vpp,
            cp=cp,
            ep=ep,
            etp=etp,
            pp_last=not mcfg.use_tp_pp_dp_mapping,
        )
    except ConfigError as e:
        raise ConfigError(
            f"{e} (world = {shape.source}; set NNODES and GPUS_PER_NODE, or trainer.nodes "
            "and trainer.gpus_per_node, to the job's shape)"
        ) from None
    validate_layout(cfg, dp)
    check_planned_moe(spec, mcfg)
    return Setup(
        cfg=cfg,
        mcfg=mcfg,
        spec=spec,
        folder=folder,
        shape=shape,
        gpu=float(gpu_gb) * GB,
        tp=tp,
        pp=pp,
        dp=dp,
        order=rank_order(bool(mcfg.use_tp_pp_dp_mapping)),
        vocab=padded_vocab_size(spec.vocab_size, tp, int(mcfg.make_vocab_size_divisible_by)),
        engine=str(cfg.rollout.engine),
        vllm_tp=int(cfg.rollout.tensor_parallel_size),
        generation_gpus=int(cfg.rollout.generation_gpus),
        cp=cp,
        ep=ep,
        etp=etp,
        nvls=os.environ.get("NCCL_NVLS_ENABLE", "").strip() != "0",
    )
