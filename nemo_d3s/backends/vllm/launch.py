"""How a vLLM engine's processes start beside the trainer: on the engine's own GPUs, outside
torchrun's rendezvous (``engine_env``); pure environment handling, no vLLM import."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from nemo_d3s.backends.vllm.placement import engine_devices

__all__ = ["engine_output", "own_gpus"]


# torchrun's rendezvous variables; vLLM's workers read them to join a process group.
_TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


# The trainer's settings vLLM's processes must not inherit: one hardware work queue is what
# Megatron's TP communication overlap needs (backends/megatron/parallel.py); vLLM overlaps its
# own streams (its custom all-reduce, async scheduling) and would run them one after another.
_TRAINER_ONLY_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def in_multi_rank_job() -> bool:
    """Whether this process is one rank of a multi-rank torch.distributed job."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def own_gpus(tensor_parallel_size: int) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES`` for this rank's engine, from its GPU on; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    devices = engine_devices(
        torch.cuda.current_device(),
        tensor_parallel_size,
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        gpus_on_node=torch.cuda.device_count(),
    )
    return ",".join(devices)


@contextlib.contextmanager
def engine_env(visible_devices: Optional[str]):
    """While vLLM starts: only the engine's GPUs visible (vllm 0.33 ``v1/engine/utils.py:
    427-436``), the trainer-only variables (``_TRAINER_ONLY_ENV``) hidden and, in a multi-rank
    job, the engine in its own process with torchrun's variables hidden (in-process it would
    ``new_group`` over ranks that build no engine).

    The job's stop signals reach the engine's spawned processes and shut them down (vllm 0.33
    ``v1/engine/core.py:1522-1543``); neither a blocked mask nor an ignored disposition
    survives spawn, so the trainer checkpoints without calling the engine after a stop."""
    saved = {
        k: os.environ.get(k)
        for k in (
            *_TORCHRUN_ENV,
            *_TRAINER_ONLY_ENV,
            "VLLM_ENABLE_V1_MULTIPROCESSING",
            "CUDA_VISIBLE_DEVICES",
        )
    }
    for k in _TRAINER_ONLY_ENV:
        os.environ.pop(k, None)
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    if in_multi_rank_job():
        for k in _TORCHRUN_ENV:
            os.environ.pop(k, None)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def engine_output(log_file: Optional[str]):
    """While vLLM starts its processes: this process's stdout and stderr (file descriptors 1
    and 2) point at ``log_file`` (appended), so the engine's processes, which inherit them,
    write there for the rest of their lives; restored on exit. None: no change (the job's
    terminal).

    Why: a stop signal reaches the engine's processes too (Slurm signals every process of the
    step), and vLLM's engine core then dumps its worker's death as two tracebacks (vllm 0.33
    ``v1/engine/core.py:1512``, and multiprocessing's own) beside the trainer's one-line
    "stopped at step N". The trainer names the file when the engine fails. What this process
    itself prints while the engine starts (vLLM's start-up lines) goes to the file as well."""
    if log_file is None:
        yield
        return
    import sys

    os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)
