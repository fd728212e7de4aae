"""The CUDA side of the rollout worker thread (``trainer/pipeline.py``): the device and the
stream an overlapped generation runs on. A CPU process switches nothing (the CPU twin)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

__all__ = ["trainer_device", "worker_stream"]


def trainer_device(torch) -> Optional[int]:
    """The CUDA device the calling (trainer) thread uses, None on a CPU process: the worker
    thread must select it itself (the CUDA runtime's current device is per host thread, a new
    one starting on device 0; torch's pin-memory thread sets its own the same way, torch 2.13
    ``utils/data/_utils/pin_memory.py:24``)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.current_device())


def worker_stream(torch, device: Optional[int]) -> Callable[[], ContextManager]:
    """The worker's generation context, set up on the worker thread: on a CUDA process
    (``device``: :func:`trainer_device`) that thread's current device is the trainer's (else
    rank r's worker made a context and a stream on GPU 0, and its engine's wake emptied GPU
    0's cache instead of its own) and a stream of its own on it, so an engine that generates
    on the trainer's GPU (the HF sampler's replica) runs beside the update's kernels instead
    of queueing behind them on the default stream (torch's current stream is per thread, a
    new thread starting on the default stream: torch 2.13 ``c10/cuda/CUDAStream.cpp:168``
    ``thread_local ... current_streams``), first waiting for the default stream, where the
    trainer's refit wrote the weights it reads; the rollouts come back to the CPU (a host
    sync on that stream) before the trainer refits again. The CPU twin: nothing to switch."""
    if device is None:
        return contextlib.nullcontext
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def on_side():
        stream.wait_stream(torch.cuda.default_stream(device))
        with torch.cuda.stream(stream):
            yield

    return on_side
