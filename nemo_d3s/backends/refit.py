"""Weight refit: the policy's weights into a rollout engine's own copy, in buckets of at
most ``bucket_bytes`` (a larger tensor alone), GPU to GPU where there are GPUs.

The source (``Policy.refit_weights``, collective on a sharded policy) streams; the sink
(:class:`WeightSink`, held by ``src`` only) receives. ``direct``: an in-process engine gets
the tensors themselves (vllm 0.33 ``v1/executor/uniproc_executor.py:90-106``). ``cuda_ipc`` /
``shm``: each staging rank copies the bucket into one reused buffer (``staging.py``), the
handles are gathered on ``src`` and the engine copies the bucket out before the gloo barrier
that lets the buffer be refilled, as vLLM 0.33's ``weight_transfer/ipc_engine.py:413-434``.
Ranks that stage nothing run the source's collectives and drop each tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from nemo_d3s.backends.staging import StagingBuffer, copy_into, tensors_from_buffer
from nemo_d3s.fault_points import fault_point

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "RefitStats",
    "TensorMeta",
    "WeightRefit",
    "WeightSink",
    "copy_into",
    "iter_buckets",
    "release_cached_cuda_memory",
    "tensors_from_buffer",
]

log = logging.getLogger("nemo_d3s.refit")

DEFAULT_BUCKET_BYTES = 512 * 2**20
TRANSPORTS = ("direct", "cuda_ipc", "shm")
STAGED = ("cuda_ipc", "shm")  # through a reused staging buffer (backends/staging.py)
# (HF name, dtype name without "torch.", shape, byte offset in the bucket): plain builtins,
# which vLLM's RPC encodes as they are (msgpack; a torch.Tensor would not survive it).
TensorMeta = Tuple[str, str, List[int], int]


@dataclass
class Bucket:
    """One bucket: ``meta`` (plain) + the tensors it describes (on the source's device)."""

    meta: List[TensorMeta]
    tensors: List[torch.Tensor]
    nbytes: int


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a refit bucket")
    return dt


def iter_buckets(
    weights: Iterable[Tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: Optional[torch.dtype] = None,
    *,
    cast: bool = True,
) -> Iterator[Bucket]:
    """Buckets of at most ``bucket_bytes`` (a larger tensor alone), floating tensors sized
    (and with ``cast`` cast) as ``dtype``. Boundaries depend on names, shapes and ``dtype``
    only, so every rank cuts the same buckets; holds one bucket's tensors at once."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    meta: List[TensorMeta] = []
    tensors: List[torch.Tensor] = []
    size = 0
    for name, t in weights:
        t = t.detach()
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if cast and t.dtype != target:
            t = t.to(target)
        n = t.numel() * target.itemsize
        if tensors and size + n > bucket_bytes:
            yield Bucket(meta, tensors, size)
            meta, tensors, size = [], [], 0
        meta.append((str(name), _dtype_name(target), [int(s) for s in t.shape], size))
        tensors.append(t)
        size += n
    if tensors:
        yield Bucket(meta, tensors, size)


def release_cached_cuda_memory(device: Optional[torch.device]) -> bool:
    """``empty_cache`` on an initialised CUDA ``device`` so another process's engine can take
    the blocks; returns whether it freed."""
    if device is None or torch.device(device).type != "cuda":
        return False
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    torch.cuda.synchronize(device)  # blocks still used by queued kernels are not free yet
    torch.cuda.empty_cache()
    return True


class WeightSink(Protocol):
    """The engine side of a refit (held by ``src`` only)."""

    def begin_refit(self) -> None:
        """Get ready to receive (wake the engine's weight memory)."""

    def load_tensors(self, meta: List[TensorMeta], tensors: List[torch.Tensor]) -> None: ...

    def load_staged_bucket(self, meta: List[TensorMeta], handles: Dict[str, tuple]) -> None:
        """``handles``: GPU UUID (or host:slot) -> staging handle; copied out on return."""

    def end_refit(self) -> None: ...


@dataclass
class RefitStats:
    """What one refit moved: ``max_bucket_bytes`` bounds the memory in flight."""

    tensors: int = 0
    buckets: int = 0
    total_bytes: int = 0
    max_bucket_bytes: int = 0
    staged_bytes: int = 0  # bytes this rank copied into a staging buffer (cuda_ipc / shm)
    staging_allocations: int = 0  # staging buffers this rank allocated (1: one reused buffer)
    names: List[str] = field(default_factory=list)


class WeightRefit:
    """Moves weights from a (possibly sharded) policy into one engine.

    group: gloo group of the source's ranks (None: one); src: the sink's global rank;
    hosts_engine_gpu: this rank stages for an engine worker (CPU twin: worker ``rank - src``);
    dtype: the engine's weight dtype.
    """

    def __init__(
        self,
        sink: Optional[WeightSink],
        *,
        transport: str,
        group: Optional[dist.ProcessGroup] = None,
        src: int = 0,
        hosts_engine_gpu: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"refit transport must be one of {TRANSPORTS}, got {transport!r}")
        self.sink, self.transport, self.group, self.src = sink, transport, group, int(src)
        self.hosts_engine_gpu, self.bucket_bytes, self.dtype = (
            bool(hosts_engine_gpu),
            int(bucket_bytes),
            dtype,
        )
        self.device = device
        self.staging: Optional[StagingBuffer] = None
        if self.is_src and sink is None:
            raise ValueError("the refit's src rank needs the engine (sink)")

    @property
    def single(self) -> bool:
        return (
            self.group is None or not dist.is_initialized() or dist.get_world_size(self.group) == 1
        )

    @property
    def is_src(self) -> bool:
        return self.single or dist.get_rank() == self.src

    @property
    def staged(self) -> bool:
        return self.transport in STAGED

    def barrier(self) -> None:
        """Every rank of the group waits here (gloo: on the host, not on a GPU)."""
        if not self.single:
            dist.barrier(group=self.group)

    def free_for_engine(self) -> None:
        """Every rank frees its cached CUDA blocks, then all wait, before the engine wakes."""
        release_cached_cuda_memory(self.device)
        self.barrier()

    def agree(self, error: Optional[BaseException]) -> None:
        """Collective barrier that raises on every rank if any rank failed (a MIN all-reduce
        on the gloo group), instead of leaving the others waiting until the timeout."""
        if not self.single:
            ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if error is not None:
            raise error
        if not self.single and int(ok.item()) == 0:
            raise RuntimeError(
                f"refit failed on another rank of the group (the engine's rank {self.src} says why)"
            )

    def push(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> RefitStats:
        """One refit, collective over ``group``; no rank refills its buffer before the
        bucket's :meth:`agree`. Returns this rank's :class:`RefitStats`."""
        stats = RefitStats()
        self.free_for_engine()
        self.agree(_attempt(self.sink.begin_refit) if self.is_src else None)
        if self.staged and self.hosts_engine_gpu:
            slot = 0 if self.single else dist.get_rank() - self.src
            self.staging = StagingBuffer(self.transport, self.bucket_bytes, slot)
        try:
            moves = self.is_src or self.staging is not None
            for bucket in iter_buckets(weights, self.bucket_bytes, self.dtype, cast=moves):
                fault_point("refit.bucket")
                self.agree(self._move(bucket, stats))
                stats.tensors += len(bucket.meta)
                stats.buckets += 1
                stats.total_bytes += bucket.nbytes
                stats.max_bucket_bytes = max(stats.max_bucket_bytes, bucket.nbytes)
                stats.names += [m[0] for m in bucket.meta]
                if self.staging is not None:
                    self.staging.opened()  # the engine has mapped it: its file name can go
            # the engine lets go of the staging buffers here, before any rank frees its own
            self.agree(_attempt(self.sink.end_refit) if self.is_src else None)
        finally:
            if self.staging is not None:
                stats.staging_allocations = self.staging.allocations
                self.staging.drop()
                self.staging = None
        return stats

    def _move(self, bucket: Bucket, stats: RefitStats) -> Optional[BaseException]:
        """One bucket to the engine; this rank's failure or None. Every rank gathers."""
        if not self.staged:
            if self.is_src:  # other ranks only served the source's collectives
                return _attempt(lambda: self.sink.load_tensors(bucket.meta, bucket.tensors))
            return None
        handle, error = None, None
        if self.staging is not None:
            try:
                handle = self.staging.stage(bucket)
                stats.staged_bytes += bucket.nbytes
            except Exception as e:  # (a staging buffer the GPU has no room for)
                error = e
        if self.single:
            handles = [handle]
        else:
            handles = [None] * dist.get_world_size(self.group) if self.is_src else None
            dist.gather_object(handle, handles, dst=self.src, group=self.group)
        if self.is_src and error is None:
            by_key = dict(h for h in handles if h is not None)
            error = _attempt(lambda: self.sink.load_staged_bucket(bucket.meta, by_key))
        return error


def _attempt(fn) -> Optional[BaseException]:
    """``fn()``; the exception it raised, or None."""
    try:
        fn()
    except Exception as e:
        return e
    return None
