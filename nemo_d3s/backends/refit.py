"""Weight refit: the policy's current weights into a rollout engine's own copy, in bounded
buckets, GPU to GPU where there are GPUs.

The object between a policy and an engine (in the spirit of NeMo-RL's weight-sync
interfaces: the policy streams, the generation side receives, a small transfer object in
between). Three parties:

- the source: ``Policy.refit_weights()``, (HF name, full tensor) one at a time, left on
  the policy's device; collective on a sharded policy (every rank of a TP x PP group runs
  it and gets the same full tensors);
- the sink (:class:`WeightSink`): the engine; only the group's ``src`` rank holds it;
- :class:`WeightRefit`: cuts the stream into buckets of at most ``bucket_bytes`` (a tensor
  larger than that is a bucket of its own) and moves each bucket with one of two transports:

  ``direct``: the engine runs in this process (vLLM's single-process executor calls the
  worker's method with the objects themselves, vllm 0.33 ``v1/executor/uniproc_executor.py:
  90-106``): the bucket's tensors are handed over as they are, no copy.

  ``host``: ``src`` packs the bucket into one bytes object (name, dtype, shape, offset per
  tensor + the raw bytes; no pickle) and hands it to the sink: the CPU build with the engine
  in another process. Peak: one bucket.

  ``cuda_ipc``: every rank whose GPU carries an engine worker copies the bucket into its own
  staging buffer (GPU memory, ``bucket_bytes``), exports it once as a CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor``), the handles are gathered on ``src``
  and the sink's workers open the one on their own GPU (picked by GPU UUID) and load from
  it: the weights go GPU to GPU on each device, never through host memory. This is how vLLM
  0.33's own colocated transfer works (``distributed/weight_transfer/ipc_engine.py:182-245``
  receiver, ``:339-377`` handle gather, ``:413-434`` one reused buffer + a barrier per chunk)
  and vLLM's ``examples/offline_inference/rlhf_utils.py`` (``rebuild_ipc``).

Ranks that host no engine GPU (other pipeline stages on other nodes) run the source for its
collectives and drop each tensor: no host copy, no staging. Every rank of the group waits
for the sink's bucket on a gloo barrier (``group`` is a gloo group): never inside an NCCL
collective that spins on the GPUs the engine uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "RefitStats",
    "TensorMeta",
    "WeightRefit",
    "WeightSink",
    "decode_host",
    "iter_buckets",
    "pack_host",
    "release_cached_cuda_memory",
    "tensors_from_buffer",
]

log = logging.getLogger("nemo_d3s.refit")

DEFAULT_BUCKET_BYTES = 512 * 2**20
# (HF name, dtype name without "torch.", shape, byte offset in the bucket): plain builtins,
# which vLLM's RPC encodes as they are (msgpack; a torch.Tensor would not survive it).
TensorMeta = Tuple[str, str, List[int], int]


@dataclass
class Bucket:
    """One bucket: ``meta`` (plain) + the tensors it describes (on the source's device)."""

    meta: List[TensorMeta]
    tensors: List[torch.Tensor]
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
    """Consecutive (name, tensor) pairs grouped into buckets of at most ``bucket_bytes``
    (a larger tensor alone), floating tensors sized (and, with ``cast``, cast: one tensor's
    copy at a time, on its device) as ``dtype`` when given. The boundaries depend on the
    names, shapes and ``dtype`` only, so every rank of a group cuts the same buckets; a rank
    that moves nothing passes ``cast=False``. Holds one bucket's tensors at once."""
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


def _copy_into(buffer: torch.Tensor, bucket: Bucket) -> None:
    for (_, _, _, off), t in zip(bucket.meta, bucket.tensors):
        buffer[off : off + _nbytes(t)].copy_(t.contiguous().reshape(-1).view(torch.uint8))


def pack_host(bucket: Bucket) -> bytes:
    """The bucket's tensors as one bytes object (host memory: one bucket)."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
    _copy_into(buf, bucket)
    return buf.numpy().tobytes()


def tensors_from_buffer(
    meta: Sequence[TensorMeta], buffer: torch.Tensor
) -> List[Tuple[str, torch.Tensor]]:
    """Views of a uint8 ``buffer`` (host or GPU) as the named tensors ``meta`` describes."""
    out = []
    for name, dtype, shape, off in meta:
        dt = _dtype(dtype)
        n = dt.itemsize * int(torch.Size(shape).numel())
        if off < 0 or off + n > buffer.numel():
            raise ValueError(
                f"refit bucket: {name!r} at bytes {off}..{off + n} lies outside the "
                f"{buffer.numel()}-byte buffer"
            )
        out.append((str(name), buffer[off : off + n].view(dt).reshape(shape)))
    return out


def decode_host(meta: Sequence[TensorMeta], raw: bytes) -> List[Tuple[str, torch.Tensor]]:
    """:func:`pack_host`'s bytes back to named tensors (one copy of the bucket)."""
    return tensors_from_buffer(meta, torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def release_cached_cuda_memory(device: Optional[torch.device]) -> bool:
    """Give the CUDA caching allocator's free blocks back to the driver (``empty_cache``),
    so that an engine in another process can take them when it wakes. Only when ``device``
    is a CUDA device and CUDA is initialised in this process; returns whether it freed."""
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

    def load_host_bucket(self, meta: List[TensorMeta], raw: bytes) -> None: ...

    def load_ipc_bucket(self, meta: List[TensorMeta], handles: Dict[str, tuple]) -> None:
        """``handles``: GPU UUID -> plain CUDA IPC handle of that GPU's staging buffer."""

    def end_refit(self) -> None: ...


@dataclass
class RefitStats:
    """What one refit moved: ``max_bucket_bytes`` bounds the memory in flight."""

    tensors: int = 0
    buckets: int = 0
    total_bytes: int = 0
    max_bucket_bytes: int = 0
    staged_bytes: int = 0  # bytes this rank copied into a staging buffer (cuda_ipc)
    names: List[str] = field(default_factory=list)


class WeightRefit:
    """Moves weights from a (possibly sharded) policy into one engine; see the module docstring.

    sink: the engine on ``src`` (None elsewhere); transport: ``"direct"``, ``"host"`` or
    ``"cuda_ipc"``;
    group: a gloo group of the ranks that run the source together (None: one rank);
    src: global rank of the sink's rank; hosts_engine_gpu: this rank's GPU carries an engine
    worker (it stages buckets for ``cuda_ipc``); dtype: the engine's weight dtype (the stream
    is cast to it before it moves); stage: how a rank exports a bucket for ``cuda_ipc``
    (default :func:`stage_cuda_ipc`; tests pass a CPU stand-in).
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
        stage: Optional[Callable[["WeightRefit", Bucket], Optional[Tuple[str, tuple]]]] = None,
    ) -> None:
        if transport not in ("direct", "host", "cuda_ipc"):
            raise ValueError(
                f"refit transport must be 'direct', 'host' or 'cuda_ipc', got {transport!r}"
            )
        self.sink, self.transport, self.group, self.src = sink, transport, group, int(src)
        self.hosts_engine_gpu, self.bucket_bytes, self.dtype = (
            bool(hosts_engine_gpu),
            int(bucket_bytes),
            dtype,
        )
        self.device = device
        self._stage = stage or stage_cuda_ipc
        self._buffer: Optional[torch.Tensor] = None
        self._handle: Optional[Tuple[str, tuple]] = None
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

    def barrier(self) -> None:
        """Every rank of the group waits here (gloo: on the host, not on a GPU)."""
        if not self.single:
            dist.barrier(group=self.group)

    def free_for_engine(self) -> None:
        """Before the engine wakes: every rank frees its cached CUDA blocks, then all wait
        until all have (so the engine finds them free)."""
        release_cached_cuda_memory(self.device)
        self.barrier()

    def push(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> RefitStats:
        """One refit; collective over ``group``. Returns this rank's :class:`RefitStats`."""
        stats = RefitStats()
        self.free_for_engine()
        if self.is_src:
            self.sink.begin_refit()
        try:
            moves = self.is_src or (self.transport == "cuda_ipc" and self.hosts_engine_gpu)
            for bucket in iter_buckets(weights, self.bucket_bytes, self.dtype, cast=moves):
                self._move(bucket, stats)
                stats.tensors += len(bucket.meta)
                stats.buckets += 1
                stats.total_bytes += bucket.nbytes
                stats.max_bucket_bytes = max(stats.max_bucket_bytes, bucket.nbytes)
                stats.names += [m[0] for m in bucket.meta]
                # nobody runs ahead (into the next NCCL gather) or refills a buffer being read
                self.barrier()
            if self.is_src:
                self.sink.end_refit()  # the engine lets go of the staging buffers here
            self.barrier()  # ... before any rank frees its own
        finally:
            self._drop_buffer()
        return stats

    def _move(self, bucket: Bucket, stats: RefitStats) -> None:
        if self.transport != "cuda_ipc":
            if self.is_src and self.transport == "direct":
                self.sink.load_tensors(bucket.meta, bucket.tensors)
            elif self.is_src:  # other ranks only served the source's collectives
                self.sink.load_host_bucket(bucket.meta, pack_host(bucket))
            return
        handle = self._stage(self, bucket) if self.hosts_engine_gpu else None
        if handle is not None:
            stats.staged_bytes += bucket.nbytes
        if self.single:
            handles = [handle]
        else:
            handles = [None] * dist.get_world_size(self.group) if self.is_src else None
            dist.gather_object(handle, handles, dst=self.src, group=self.group)
        if self.is_src:
            by_gpu = dict(h for h in handles if h is not None)
            self.sink.load_ipc_bucket(bucket.meta, by_gpu)

    def _drop_buffer(self) -> None:
        if self._buffer is None:
            return
        self._buffer, self._handle = None, None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # blocks the engine has let go of return to the allocator


# ----------------------------------------------------------------------------- CUDA IPC
def plain_ipc_handle(args: tuple) -> tuple:
    """The argument tuple of ``reduce_tensor(t)[1]`` for a CUDA tensor (torch
    ``multiprocessing/reductions.py``: ``rebuild_cuda_tensor``'s 15 arguments) with the two
    class objects dropped and sizes as lists: only ints, bytes, bools and a dtype name, which
    vLLM's RPC carries without pickle."""
    (
        _tensor_cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_bytes,
        storage_offset,
        requires_grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return (
        list(size),
        list(stride),
        int(offset),
        _dtype_name(dtype),
        int(device),
        bytes(handle),
        int(storage_bytes),
        int(storage_offset),
        bool(requires_grad),
        bytes(ref_handle),
        int(ref_offset),
        bytes(event_handle) if event_handle is not None else None,
        bool(event_sync),
    )


def rebuild_ipc_tensor(plain: tuple, device_index: int) -> torch.Tensor:
    """Open a :func:`plain_ipc_handle` in the receiving process on ITS device index (the
    sender's index means another GPU under another ``CUDA_VISIBLE_DEVICES``: vLLM's
    ``ipc_engine.py:234-237`` and ``rlhf_utils.py`` ``rebuild_ipc`` overwrite argument 6 the
    same way)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (
        size,
        stride,
        offset,
        dtype,
        _device,
        handle,
        storage_bytes,
        storage_offset,
        requires_grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = plain
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(size),
        tuple(stride),
        offset,
        torch.storage.TypedStorage,
        _dtype(dtype),
        int(device_index),
        handle,
        storage_bytes,
        storage_offset,
        requires_grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    )


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID, the key both sides agree on whatever their CUDA_VISIBLE_DEVICES (vLLM
    ``ipc_engine.py:222-223`` uses ``get_device_properties(i).uuid`` the same way)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def stage_cuda_ipc(refit: WeightRefit, bucket: Bucket) -> Tuple[str, tuple]:
    """Copy ``bucket`` into this rank's staging buffer (GPU; allocated on first use at
    ``bucket_bytes``, or once at a larger single tensor's size) and return (GPU UUID, its
    plain IPC handle). The buffer is exported once per refit and reused bucket after bucket
    (the barrier in :meth:`WeightRefit.push` keeps it from being refilled while read)."""
    from torch.multiprocessing.reductions import reduce_tensor

    device = bucket.tensors[0].device
    if device.type != "cuda":
        raise ValueError(
            f"cuda_ipc refit of tensors on {device}: the policy's weights must be on the GPU"
        )
    if refit._buffer is None or refit._buffer.numel() < bucket.nbytes:
        refit._buffer = torch.empty(
            max(refit.bucket_bytes, bucket.nbytes), dtype=torch.uint8, device=device
        )
        refit._handle = (gpu_uuid(device), plain_ipc_handle(reduce_tensor(refit._buffer)[1]))
    _copy_into(refit._buffer, bucket)
    torch.cuda.current_stream(
        device
    ).synchronize()  # the bytes are there before the engine reads them
    return refit._handle
