"""Spawn gloo ranks on CPU for the distributed tests and bring their results back.

``run_ranks(fn, world_size, *args, tp=..., pp=..., cp=...)`` starts ``world_size``
processes; each joins a gloo process group (TCP store on a free localhost port), optionally
builds Megatron's groups with ``parallel_state.initialize_model_parallel``, calls
``fn(rank, *args)`` and pickles its return value to a temporary file that the parent reads
back: the parent gets ``[result of rank 0, result of rank 1, ...]``. An exception in any
rank is re-raised in the parent with the child's traceback (and the other ranks are
killed, so a rank stuck in a collective cannot hang the test); so is a timeout.

Start method: "forkserver" with torch, megatron-core and nemo_d3s PRELOADED in the fork
server. Importing megatron.core costs ~5 s of CPU per process; this machine has two cores,
so spawning 8 fresh interpreters would spend ~20 s importing. The fork server imports once
per test session and forks ranks from that clean, single-threaded process (plain "fork" of
the pytest process could inherit a busy OpenMP pool and deadlock).

Megatron on CPU: ``initialize_model_parallel`` and the tensor-parallel layers
(``use_cpu_initialization=True``, no sequence parallelism) run on gloo as they are; no shim
is needed for them. Only the pipeline schedules allocate on "cuda"; see
``_megatron_cpu.py`` for the one shim the gradient test uses.
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.multiprocessing as tmp

_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "nemo_d3s.core",
    "nemo_d3s.distributed",
]


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(fn_ref: tuple) -> Callable:
    """The rank function from (file, name). Loading the defining file by path, instead of
    unpickling the function by module name, works under every pytest import mode."""
    path, name = fn_ref
    spec = importlib.util.spec_from_file_location(f"_nemo_d3s_rank_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _child(rank: int, fn_ref: tuple, world_size: int, port: int, mp_sizes: tuple, out_dir: str, timeout: float, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Megatron warns about this GPU-only setting on every linear layer.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    torch.set_num_threads(1)  # the machine has 2 cores for up to 8 ranks
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    ps = None
    try:
        if mp_sizes is not None:
            from megatron.core import parallel_state as ps

            tp, pp, cp = mp_sizes
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
            )
        result = _load(fn_ref)(rank, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        if ps is not None:
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    megatron: bool = True,
    timeout: float = 90.0,
) -> List[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; return every rank's result.

    ``fn`` must be a module-level function (it is pickled by reference) and its result
    picklable (move tensors to CPU). With ``megatron=True`` Megatron's parallel state is
    initialised with TP=tp, PP=pp, CP=cp (DP = world / (tp pp cp)) before ``fn`` runs.
    """
    with tempfile.TemporaryDirectory(prefix="nemo_d3s_dist_") as out_dir:
        sizes = (tp, pp, cp) if megatron else None
        ctx = tmp.start_processes(
            _child,
            args=((inspect.getfile(fn), fn.__name__), world_size, free_port(), sizes, out_dir, timeout, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks took over {timeout} s")
        except BaseException:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited without a result")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


def _set_preload() -> None:
    try:
        multiprocessing.set_forkserver_preload(_PRELOAD)
    except Exception:  # pragma: no cover - preloading is only an optimisation
        traceback.print_exc()


_set_preload()
