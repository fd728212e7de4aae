"""The set-up steps of :class:`~nemo_d3s.backends.megatron.backend.MegatronBackend`: dtype,
model folder, weights reader (headers only), process groups, seeding, weight loading, LR
schedule. The checks that can fail on bad input run before the first collective.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.hf.config import TinyModelSpec
from nemo_d3s.backends.hf.gguf_convert import DEFAULT_MODEL_NAME
from nemo_d3s.backends.hf.loading import TINY_RANDOM, ensure_tiny_folder, resolve_model_path
from nemo_d3s.backends.megatron.config import DTYPES, MegatronBackendConfig
from nemo_d3s.backends.megatron.model import load_stage_from_hf
from nemo_d3s.distributed.groups import ParallelGroups, init_world
from nemo_d3s.errors import ConfigError
from nemo_d3s.formats.detect import MEGATRON, MEGATRON_LM, NEMO2, FolderFormat, detect_format
from nemo_d3s.formats.mcore_config import checkpoint_hf_config, resolve_iteration
from nemo_d3s.formats.mcore_dist import open_mcore_weights
from nemo_d3s.formats.mcore_dist import write_side_folder as write_mcore_side_folder
from nemo_d3s.formats.nemo2 import open_nemo2_weights, write_side_folder
from nemo_d3s.formats.shards import (
    ShardedReader,
    check_shards,
    read_layout,
    read_local_from_checkpoint,
)
from nemo_d3s.formats.spec import ModelSpec
from nemo_d3s.formats.weights import Layout, SafetensorsReader

__all__ = [
    "LRSchedule",
    "init_groups",
    "load_chunks",
    "model_dtype",
    "model_folder",
    "open_weights",
    "seed_model_rng",
    "world_size",
]

_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES -> torch dtype


class LRSchedule:
    """LR = base x ``lr_multiplier`` of the step, set on the optimizer's param groups; works
    for torch optimizers and Megatron's (which torch's LRScheduler does not accept)."""

    def __init__(self, optimizer, base_lr: float, fn) -> None:
        self.optimizer, self.base_lr, self.fn, self.step_count = optimizer, base_lr, fn, 0
        self._apply()

    def _apply(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = self.base_lr * self.fn(self.step_count)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def set_step(self, n: int) -> None:
        self.step_count = int(n)
        self._apply()


def world_size() -> int:
    """The job's world size: the process group's, else ``WORLD_SIZE`` (1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def model_dtype(cfg: MegatronBackendConfig, device: torch.device) -> torch.dtype:
    """``dtype=auto``: bf16 on CUDA, fp32 on the CPU."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.dtype]


def model_folder(cfg: MegatronBackendConfig) -> str:
    """The local folder ``cfg.model`` names; "tiny-random" (smoke runs) is the HF backend's
    random Llama, written once to the cache."""
    try:
        if cfg.model == TINY_RANDOM:
            return str(ensure_tiny_folder(TinyModelSpec(), cfg.seed))
        return str(resolve_model_path(cfg.model))
    except FileNotFoundError as e:
        raise ConfigError(
            f"{e} (the Megatron backend builds from a Hugging Face folder, a NeMo 2 or "
            "Megatron-LM / Megatron-Bridge checkpoint, "
            f"{DEFAULT_MODEL_NAME!r} or {TINY_RANDOM!r})"
        ) from None


def open_weights(path: str, spec: ModelSpec, owner: Any) -> Tuple[Any, str, FolderFormat]:
    """(reader, HF-style folder, format) of the weights at ``path`` (HF, converted Megatron,
    NeMo 2 or Megatron-LM / Bridge); headers only, no collective. A NeMo 2 or Megatron-LM
    checkpoint's config and tokenizer go into an HF-style folder removed with ``owner``."""
    fmt = detect_format(path)
    if fmt.kind == NEMO2:
        reader, _ = open_nemo2_weights(Path(path), spec)
        side = tempfile.mkdtemp(prefix="nemo_d3s_nemo2_")
        weakref.finalize(owner, shutil.rmtree, side, True)
        return reader, str(write_side_folder(Path(path), Path(side))), fmt
    if fmt.kind == MEGATRON_LM:
        it = resolve_iteration(path)
        reader, _ = open_mcore_weights(it, spec, checkpoint_hf_config(it)[1])
        side = tempfile.mkdtemp(prefix="nemo_d3s_mcore_")
        weakref.finalize(owner, shutil.rmtree, side, True)
        return reader, str(write_mcore_side_folder(it, Path(side))), fmt
    if fmt.kind == MEGATRON:
        saved = read_layout(fmt.shards, spec)
        check_shards(fmt.shards, spec, saved)  # a truncated shard is one line naming it
        return ShardedReader(fmt.shards, spec, saved), path, fmt
    reader = SafetensorsReader(path, spec)
    reader.check()
    return reader, path, fmt


def load_chunks(
    chunks: Sequence[torch.nn.Module], layouts: Sequence[Layout], spec: ModelSpec, reader: Any
) -> None:
    """Copy each chunk's weights from ``reader`` (its layout's rows of the weight table);
    an HF reader is closed afterwards."""
    for chunk, lay in zip(chunks, layouts):
        if isinstance(reader, ShardedReader):
            with torch.no_grad():
                for name, prm in chunk.named_parameters():
                    prm.copy_(read_local_from_checkpoint(name, spec, lay, reader, prm.dtype))
        else:
            load_stage_from_hf(chunk, spec, lay, reader)
    if not isinstance(reader, ShardedReader):
        reader.close()


def seed_model_rng(device: torch.device, seed: int) -> None:
    """Megatron's RNG tracker (per-TP-rank streams for dropout and init): its attention
    forks the tracker even at dropout 0, so it must be seeded before the first forward."""
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from nemo_d3s.backends.megatron.cpu_compat import seed_model_parallel

        seed_model_parallel(seed)


def init_groups(
    cfg: MegatronBackendConfig,
    device: torch.device,
    tp: int,
    pp: int,
    vpp: int,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
) -> ParallelGroups:
    """Megatron's ``initialize_model_parallel`` on the job's process group (collective),
    experts at ``ep`` x ``etp`` (None: TP); an existing Megatron layout of the same TP x PP x
    VPP x CP x EP x ETP is reused (e.g. by a test harness). The world, Megatron's groups and the
    gloo twin of the model-parallel group all wait ``cfg.dist_timeout_minutes``
    (``distributed.timeouts``); the twin is made from the layout
    (``parallel.make_model_parallel_gloo_twin``), with no NCCL collective."""
    from megatron.core import parallel_state as ps

    from nemo_d3s.backends.megatron import parallel as par
    from nemo_d3s.distributed.timeouts import apply_timeout, as_timedelta

    order = par.rank_order(cfg.use_tp_pp_dp_mapping)
    timeout = as_timedelta(cfg.dist_timeout_minutes)
    if world_size() <= 1 and not dist.is_initialized():
        # Megatron's groups need a process group even for one process: a private
        # one-rank group on an in-memory store (no port, no rendezvous).
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            **({"timeout": timeout} if timeout else {}),
        )
        world = ParallelGroups(
            device=device if device.type == "cuda" else torch.device("cpu"), owns_world=True
        )
    else:
        world = init_world(str(device), cfg.dist_timeout_minutes)
    if ps.model_parallel_is_initialized() and world.owns_world:
        ps.destroy_model_parallel()  # left from an earlier process group of this process
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        want = (tp, pp, vpp, cp, ep, tp if etp is None else etp)
        if have != want:
            raise ValueError(
                f"Megatron is already initialised at TP x PP x VPP x CP x EP x ETP = {have}, "
                f"not {want}"
            )
        if par.model_parallel_gloo_group() is None:  # initialised by other code
            par.make_model_parallel_gloo_twin(tp, pp, order, cfg.dist_timeout_minutes, cp=cp)
        apply_timeout(timeout)
    else:
        par.initialize_megatron_groups(
            world.global_rank,
            tp,
            pp,
            cp,
            order=order,
            vpp=vpp,
            timeout_minutes=cfg.dist_timeout_minutes,
            ep=ep,
            etp=etp,
        )
    single = lambda g: None if dist.get_world_size(g) == 1 else g  # noqa: E731
    return ParallelGroups(
        dp=single(ps.get_data_parallel_group()),
        tp=single(ps.get_tensor_model_parallel_group()),
        pp=single(ps.get_pipeline_model_parallel_group()),
        cp=single(ps.get_context_parallel_group()),
        device=world.device,
        global_rank=world.global_rank,
        owns_world=world.owns_world,
    )
